//! speedkit's C ABI is declared once, in `speedkit/shim/speedkit.h`: every shim file includes it, so
//! the C++ compiler refuses a definition that differs from its declaration, and speedkit's build
//! script generates the Rust declarations from the same header. Kernel launches are typed: a launch
//! takes the params struct of its kernel and no other. These tests compile small translation units
//! with the system's C and C++ compilers (the ones that build the shim) to show each refusal, with
//! a control that compiles, so that a test cannot pass by a compiler that refuses everything.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn shim() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("speedkit/shim")
}

/// Compiles `source` (C or C++) for syntax only, with the shim's headers on the include path;
/// the compiler's verdict and its messages.
fn compiles(source: &str, language: &str) -> (bool, String) {
    let dir = std::env::temp_dir().join(format!("speedkit-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let file = dir.join(format!("{:x}.{language}", fxhash(source)));
    std::fs::write(&file, source).expect("the source is written");
    let (compiler, standard) = match language {
        "c" => (
            std::env::var("CC").unwrap_or_else(|_| "cc".into()),
            "-std=c11",
        ),
        _ => (
            std::env::var("CXX").unwrap_or_else(|_| "c++".into()),
            "-std=c++20",
        ),
    };
    let output = Command::new(&compiler)
        .args([
            "-fsyntax-only",
            standard,
            "-x",
            if language == "c" { "c" } else { "c++" },
        ])
        .arg("-I")
        .arg(shim())
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("{compiler} cannot be run: {e}"));
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn fxhash(text: &str) -> u64 {
    text.bytes().fold(0xcbf29ce484222325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
    })
}

#[test]
fn the_header_is_plain_c() {
    let (ok, log) = compiles(
        "#include \"speedkit.h\"\nint main(void) { return 0; }\n",
        "c",
    );
    assert!(ok, "{log}");
}

#[test]
fn a_definition_as_declared_compiles() {
    let (ok, log) = compiles(
        "#include \"speedkit.h\"\nextern \"C\" int sk_cuda_device_count(int* out) { *out = 0; return 0; }\n",
        "cpp",
    );
    assert!(ok, "{log}");
}

#[test]
fn a_definition_that_differs_from_its_declaration_does_not_compile() {
    let (ok, log) = compiles(
        "#include \"speedkit.h\"\nextern \"C\" int sk_cuda_device_count(long* out) { *out = 0; return 0; }\n",
        "cpp",
    );
    assert!(!ok, "a changed parameter type compiled");
    assert!(log.contains("sk_cuda_device_count"), "{log}");
}

const TWO_KERNELS: &str = "#include \"launch.h\"
struct Scale { float* x; float k; int n; };
struct Shift { float* x; float by; };
void sk::kernels::launch_raw(const Kernel&, Dim3, Dim3, int, void**) {}
";

#[test]
fn a_launch_with_its_own_params_struct_compiles() {
    let (ok, log) = compiles(
        &format!(
            "{TWO_KERNELS}void run(const sk::kernels::TypedKernel<Scale>& k) {{ \
             sk::kernels::launch(k, {{1, 1, 1}}, {{32, 1, 1}}, 0, Scale{{nullptr, 2.f, 0}}); }}\n"
        ),
        "cpp",
    );
    assert!(ok, "{log}");
}

#[test]
fn a_launch_with_another_kernels_params_struct_does_not_compile() {
    let (ok, log) = compiles(
        &format!(
            "{TWO_KERNELS}void run(const sk::kernels::TypedKernel<Scale>& k) {{ \
             sk::kernels::launch(k, {{1, 1, 1}}, {{32, 1, 1}}, 0, Shift{{nullptr, 1.f}}); }}\n"
        ),
        "cpp",
    );
    assert!(!ok, "a launch with the wrong params struct compiled");
    assert!(log.contains("launch"), "{log}");
}

/// The names of the `sk_*` functions the shim's .cpp files define.
fn defined_in_the_shim() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for entry in std::fs::read_dir(shim()).expect("speedkit/shim") {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_none_or(|e| e != "cpp") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("a shim file");
        for line in text.lines() {
            let Some(rest) = ["int ", "void ", "const char* "]
                .iter()
                .find_map(|ret| line.strip_prefix(ret))
            else {
                continue;
            };
            if let Some((name, _)) = rest.split_once('(') {
                if name.starts_with("sk_") {
                    names.insert(name.to_owned());
                }
            }
        }
    }
    names
}

#[test]
fn every_function_the_shim_defines_is_declared_in_the_header_and_no_other() {
    let header = std::fs::read_to_string(shim().join("speedkit.h")).expect("speedkit.h");
    let declared: BTreeSet<String> = speedkit_build::abi::parse(&header)
        .expect("the header parses")
        .into_iter()
        .flat_map(|module| module.items)
        .filter_map(|item| match item {
            speedkit_build::abi::Item::Function { name, .. } => Some(name),
            _ => None,
        })
        .collect();
    let defined = defined_in_the_shim();
    assert!(defined.len() > 50, "found only {defined:?}");
    let undeclared: Vec<_> = defined.difference(&declared).collect();
    let undefined: Vec<_> = declared.difference(&defined).collect();
    assert!(
        undeclared.is_empty(),
        "defined but not declared: {undeclared:?}"
    );
    assert!(
        undefined.is_empty(),
        "declared but not defined: {undefined:?}"
    );
}
