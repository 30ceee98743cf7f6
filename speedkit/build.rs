//! Compiles the C++ shim (`shim/*.cpp`, one file per concept) against the libtorch that torch-sys found, and
//! gives this package's executables an rpath to it, so they run without `LD_LIBRARY_PATH`.
//!
//! It also writes the Rust declarations of the shim's C ABI from its one header (`shim/speedkit.h`,
//! speedkit-build's `abi` module), and embeds speedkit's CUDA kernel files (`kernels/*.cuh`) in the
//! shim as a generated table of raw string literals, which the shim compiles with NVRTC at run time
//! for the GPU in use.

use std::env;
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=shim");
    println!("cargo:rerun-if-changed=kernels");
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let generated = write_kernel_table(Path::new("kernels"), &out_dir.join("kernel_sources.inc"))
        .and_then(|()| {
            write_abi_bindings(
                Path::new("shim/speedkit.h"),
                &out_dir.join("speedkit_abi.rs"),
            )
        });
    if let Err(message) = generated {
        eprintln!("{message}");
        std::process::exit(1);
    }
    // torch-sys (`links = "tch"`) publishes its lib dir as `cargo:libtorch_lib`.
    let lib_dir = match env::var("DEP_TCH_LIBTORCH_LIB") {
        Ok(dir) => PathBuf::from(dir),
        Err(_) => {
            eprintln!("torch-sys did not report a libtorch lib dir (DEP_TCH_LIBTORCH_LIB)");
            std::process::exit(1);
        }
    };
    // The wheel (and the libtorch zip) put headers at `<torch>/include` next to `<torch>/lib`.
    // Canonical, because `.venv/libtorch` is a link into site-packages, where the CUDA headers live.
    let canonical_lib = std::fs::canonicalize(&lib_dir).unwrap_or_else(|_| lib_dir.clone());
    let torch_root = canonical_lib
        .parent()
        .unwrap_or(&canonical_lib)
        .to_path_buf();
    let include = torch_root.join("include");
    let cuda_headers = find_cuda_headers(&torch_root);
    let with_cuda = lib_dir.join("libtorch_cuda.so").exists() && cuda_headers.is_some();
    // ProcessGroupNCCL's header includes <nccl.h>, shipped by the `nvidia-nccl` wheel next to torch.
    let nccl_headers = torch_root
        .parent()
        .map(|site_packages| site_packages.join("nvidia/nccl/include"))
        .filter(|dir| dir.join("nccl.h").exists());
    let with_nccl = with_cuda && nccl_headers.is_some();

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        // C++20 for designated initializers: every kernel launch names its parameters' fields.
        .std("c++20")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .define("GLOG_USE_GLOG_EXPORT", None)
        .define("SK_WITH_CUDA", if with_cuda { "1" } else { "0" })
        .define("SK_WITH_NCCL", if with_nccl { "1" } else { "0" })
        // As libtorch's release build: some of its classes (RecordFunction) have members only
        // without NDEBUG, so the shim must agree with the library on their layout.
        .define("NDEBUG", None)
        // Warnings on for speedkit's own code; libtorch's, gloo's and CUDA's headers are system
        // headers (-isystem), whose warnings are theirs.
        .warnings(true)
        .extra_warnings(true)
        .flag("-Wno-unused-parameter")
        .include("shim")
        // USE_C10D_GLOO as libtorch itself was built.
        .define("USE_C10D_GLOO", None)
        // The kernel files' host parts (their launchers), and the generated source table.
        .include("kernels")
        .include(&out_dir)
        .files(shim_sources());
    system_include(&mut build, &include);
    system_include(&mut build, &include.join("torch/csrc/api/include"));
    // gloo's headers, which ProcessGroupGloo.hpp includes and the torch wheel does not ship
    // (shim/vendor/gloo/README.md).
    system_include(&mut build, Path::new("shim/vendor"));
    if let Some(dir) = &cuda_headers {
        system_include(&mut build, dir);
        // One more place the shim looks for NVRTC at run time (after the wheel next to libtorch).
        if let Some(root) = dir.parent() {
            build.define(
                "SK_BUILD_CUDA_ROOT",
                format!("\"{}\"", root.display()).as_str(),
            );
        }
    }
    if let Some(dir) = nccl_headers.filter(|_| with_nccl) {
        // The macro ProcessGroupNCCL.hpp is guarded by, as libtorch itself was built.
        system_include(&mut build, &dir);
        build.define("USE_C10D_NCCL", None);
    }
    build.compile("speedkit_shim");

    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    if with_cuda {
        // The shim calls into these directly; torch-sys links torch_cuda but not c10_cuda.
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
        println!("cargo:rustc-cfg=speedkit_cuda");
    }
    println!("cargo:rustc-check-cfg=cfg(speedkit_cuda)");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    // Dependents' build scripts read these (`DEP_SPEEDKIT_SHIM_LIBTORCH_LIB`) to set their own rpath,
    // in one call: `speedkit_build::link_libtorch_rpath()`. (Our rpath above reaches only our own
    // executables: cargo never applies a dependency's link arguments to its dependents.)
    println!("cargo:libtorch_lib={}", lib_dir.display());
    println!("cargo:with_cuda={}", u8::from(with_cuda));
}

/// Adds `dir` as a system include directory: its headers' warnings are not ours to fix.
fn system_include(build: &mut cc::Build, dir: &Path) {
    build.flag("-isystem").flag(dir.to_string_lossy().as_ref());
}

/// Writes the Rust declarations of the shim's C ABI from its header.
fn write_abi_bindings(header: &Path, out: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(header).map_err(|e| format!("{}: {e}", header.display()))?;
    let rust = speedkit_build::abi::rust_bindings(&text)
        .map_err(|e| format!("{}: {e}", header.display()))?;
    std::fs::write(out, rust).map_err(|e| format!("{}: {e}", out.display()))
}

/// Every translation unit of the shim, in a stable order.
fn shim_sources() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir("shim")
        .expect("speedkit/shim is part of the package")
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "cpp"))
        .collect();
    files.sort();
    files
}

/// Writes `{"name.cuh", R"…"(text)"…"},` for every `*.cuh` in `dir`, sorted by name: the shim's
/// table of kernel sources (`sk::kernels::sources()`).
fn write_kernel_table(dir: &Path, table: &Path) -> Result<(), String> {
    const DELIMITER: &str = "sk_kernel_source";
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("speedkit/kernels: {e}"))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "cuh"))
        .collect();
    files.sort();
    let mut text = String::new();
    for path in &files {
        let source =
            std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        if source.contains(&format!("){DELIMITER}\"")) {
            return Err(format!(
                "{} contains the table's raw-string delimiter",
                path.display()
            ));
        }
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        text.push_str(&format!(
            "{{\"{name}\", R\"{DELIMITER}({source}){DELIMITER}\"}},\n"
        ));
    }
    std::fs::write(table, text).map_err(|e| format!("{}: {e}", table.display()))
}

/// The CUDA headers (`cuda_runtime_api.h`) from the `nvidia-cuda-*` wheels next to torch in
/// site-packages, or from a system CUDA toolkit.
fn find_cuda_headers(torch_root: &Path) -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Some(site_packages) = torch_root.parent() {
        for cu in ["cu13", "cu12", "cuda_runtime"] {
            candidates.push(site_packages.join("nvidia").join(cu).join("include"));
        }
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(home) = env::var(var) {
            candidates.push(PathBuf::from(home).join("include"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    candidates
        .into_iter()
        .find(|dir| dir.join("cuda_runtime_api.h").exists())
}
