//! Compiles the C++ shim (`shim/*.cpp`, one file per concept, in a few units: `SHIM_UNITS`) against
//! the libtorch that torch-sys found, and gives this package's executables an rpath to it, so they
//! run without `LD_LIBRARY_PATH`.
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
    // cudnn_graph.h, for the convolution plans speedkit chooses (shim/conv_plans.cpp), shipped by
    // the `nvidia-cudnn` wheel next to torch.
    let cudnn_headers = torch_root
        .parent()
        .map(|site_packages| site_packages.join("nvidia/cudnn/include"))
        .filter(|dir| with_cuda && dir.join("cudnn_graph.h").exists());

    let translation_units = match shim_translation_units(&out_dir) {
        Ok(units) => units,
        Err(message) => {
            eprintln!("{message}");
            std::process::exit(1);
        }
    };
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
        .define(
            "SK_WITH_CUDNN",
            if cudnn_headers.is_some() { "1" } else { "0" },
        )
        // As libtorch's release build: some of its classes (RecordFunction) have members only
        // without NDEBUG, so the shim must agree with the library on their layout.
        .define("NDEBUG", None)
        // Warnings on for speedkit's own code; libtorch's, gloo's and CUDA's headers are system
        // headers (-isystem), whose warnings are theirs.
        .warnings(true)
        .extra_warnings(true)
        .flag("-Wno-unused-parameter")
        // A class of a shim file with a member of a type in its anonymous namespace (GradientSync's
        // buckets) is defined in one translation unit only; the warning assumes an included file
        // is a header, which a unit's files are not.
        .flag("-Wno-subobject-linkage")
        .include("shim")
        // USE_C10D_GLOO as libtorch itself was built.
        .define("USE_C10D_GLOO", None)
        // The kernel files' host parts (their launchers), and the generated source table.
        .include("kernels")
        .include(&out_dir)
        .files(translation_units);
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
    if let Some(dir) = &cudnn_headers {
        system_include(&mut build, dir);
    }
    let nccl_headers_used = nccl_headers.filter(|_| with_nccl);
    if let Some(dir) = &nccl_headers_used {
        // The macro ProcessGroupNCCL.hpp is guarded by, as libtorch itself was built.
        system_include(&mut build, dir);
        build.define("USE_C10D_NCCL", None);
    }
    // Outside release profiles the shim is compiled the way speedkit's own `[profile.dev]` compiles
    // it (-O1, debug info), whatever opt-level and debug setting speedkit gets in the dependent's
    // profile: the suite (speedkit a member, -O1), trybuild's project (no profile, -O0) and a crate
    // of one's own (`package."*"`, -O2) then share one compiled shim (`compile_shim_cached`). The
    // shim is thin wrappers around libtorch calls, whose work happens inside libtorch.
    if env::var("PROFILE").as_deref() != Ok("release") {
        build.opt_level(1).debug(true);
    }
    // Identifies the headers from outside speedkit that the shim includes (their directories are
    // among the compiler's arguments): libtorch's version (with its git hash and CUDA variant), and
    // the CUDA, NCCL and cuDNN headers'.
    let external_headers: Vec<PathBuf> = [
        torch_root.join("version.py"),
        include.join("torch/version.h"),
    ]
    .into_iter()
    .chain(cuda_headers.map(|dir| dir.join("cuda_runtime_api.h")))
    .chain(nccl_headers_used.map(|dir| dir.join("nccl.h")))
    .chain(cudnn_headers.map(|dir| dir.join("cudnn_graph.h")))
    .collect();
    compile_shim_cached(&mut build, &out_dir, &external_headers);

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

/// The shim's files compiled together, one translation unit each. libtorch's headers take most of a
/// shim file's compile time (18 of `layernorm.cpp`'s 24 s at -O1, on one core), and each unit parses
/// them once: the fresh shim took about 500 s of CPU as 30 units, about 75 s as these two and five
/// small files (whose `Api` and `check` helpers have the same names). So the names in a file's
/// anonymous namespace must not repeat within its unit: the compiler says which when they do.
const SHIM_UNITS: &[(&str, &[&str])] = &[
    // Fused ops and overrides: autograd Functions under autocast (`fused_op.h`).
    (
        "ops",
        &[
            "bias_gelu",
            "classifier",
            "column_sums",
            "conv_plans",
            "convolution",
            "cublaslt",
            "custom_overrides",
            "depthwise_conv",
            "embedding",
            "fp8",
            "function",
            "layernorm",
            "linear",
            "overrides",
        ],
    ),
    // The runtime: c10d, the caching allocator, graphs, the profiler, the optimizer.
    (
        "runtime",
        &[
            "amp",
            "autograd",
            "deferred",
            "device",
            "distributed",
            "gradient_sync",
            "graphs",
            "heartbeat",
            "interposer",
            "kernels",
            "memory_history",
            "optim",
            "optimizer_shard",
            "parameter_residency",
            "pinned_host",
            "profiler",
            "random",
            "replay_watchdog",
            "saved_offload",
            "sensors",
            "weight_casts",
        ],
    ),
];

/// The shim's translation units, in a stable order: one file in OUT_DIR per `SHIM_UNITS` entry,
/// which includes its files, and every `shim/*.cpp` in no unit.
fn shim_translation_units(out_dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut alone: Vec<PathBuf> = std::fs::read_dir("shim")
        .map_err(|e| format!("speedkit/shim: {e}"))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "cpp"))
        .collect();
    alone.sort();
    let mut units = Vec::new();
    for (unit, files) in SHIM_UNITS {
        let mut text = format!("// The shim's `{unit}` unit (speedkit/build.rs, SHIM_UNITS).\n");
        for file in *files {
            let path = Path::new("shim").join(format!("{file}.cpp"));
            let Some(at) = alone.iter().position(|p| *p == path) else {
                return Err(format!(
                    "SHIM_UNITS names {}, which does not exist",
                    path.display()
                ));
            };
            alone.remove(at);
            // Found through the shim's include path (`-I shim`).
            text.push_str(&format!("#include \"{file}.cpp\"\n"));
        }
        let path = out_dir.join(format!("shim_unit_{unit}.cpp"));
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        units.push(path);
    }
    units.extend(alone);
    Ok(units)
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

/// Compiles the shim with `build` into `libspeedkit_shim.a` in OUT_DIR, or takes the archive an
/// earlier run left in the shim cache, and prints the `cargo:` lines that link it, as
/// `cc::Build::compile` does.
///
/// Why a cache: cargo gives every build of speedkit that differs in anything its own OUT_DIR (its
/// features, the package it is built for, the workspace and that workspace's rustflags), and `cc`
/// compiled all of the shim's C++ again in each, minutes on 2 cores: the suite builds speedkit with
/// the `runner` feature, `tests/user_crate.rs`'s crate (in the suite's build dir) without it for its
/// binary and with it for its tests, and trybuild's project under its own workspace and rustflags.
/// None of that changes the shim, which depends only on what `shim_cache_key` hashes.
///
/// An entry is `<build-dir>/<profile>/build/speedkit-shim.<key>/`, beside the build-script
/// directories of every build in that build dir (named so that `cargo clean -p speedkit`, which
/// removes `speedkit-*` there, removes it too). It is filled atomically: compiled in a directory of
/// its own, then renamed into place, so a concurrent build sees either no entry or a whole one.
/// OUT_DIR gets a hard link to (or a copy of) the archive, so a build links what its build script
/// saw even after the entry is evicted: only the `SHIM_CACHE_ENTRIES` most recently used entries
/// are kept, as every edit of the shim makes a new one (about 190 MB with debug info).
fn compile_shim_cached(build: &mut cc::Build, out_dir: &Path, external_headers: &[PathBuf]) {
    const LIBRARY: &str = "speedkit_shim";
    let archive_name = format!("lib{LIBRARY}.a");
    let (key, inputs) = shim_cache_key(build, out_dir, external_headers);
    // What the key was made of, to tell why a build missed the cache.
    let _ = std::fs::write(out_dir.join("speedkit-shim-key.txt"), &inputs);
    let shared = shared_build_dir(out_dir).unwrap_or_else(|| out_dir.to_path_buf());
    let entry = shared.join(format!("speedkit-shim.{key}"));
    let library = out_dir.join(&archive_name);
    let _ = std::fs::remove_file(&library);
    if link_or_copy(&entry.join(&archive_name), &library).is_ok() {
        touch_shim_cache_entry(&entry);
    } else {
        let staging = shared.join(format!(
            "speedkit-shim.{key}.{}.partial",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&staging);
        if let Err(e) = std::fs::create_dir_all(&staging) {
            eprintln!("{}: {e}", staging.display());
            std::process::exit(1);
        }
        build.out_dir(&staging);
        let compiled = build.try_compile_intermediates().and_then(|objects| {
            let archive = build.try_create_archive(LIBRARY, &objects)?;
            // The archive holds copies of the objects.
            for object in &objects {
                let _ = std::fs::remove_file(object);
            }
            Ok(archive)
        });
        let archive = match compiled {
            Ok(archive) => archive,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&staging);
                eprintln!("compiling the shim: {e}");
                std::process::exit(1);
            }
        };
        if let Err(e) = link_or_copy(&archive, &library) {
            eprintln!("{} -> {}: {e}", archive.display(), library.display());
            std::process::exit(1);
        }
        let _ = std::fs::write(staging.join("key.txt"), &inputs);
        touch_shim_cache_entry(&staging);
        // An entry without its archive (a removed file) is debris: replace it.
        if entry.exists() && !entry.join(&archive_name).is_file() {
            let _ = std::fs::remove_dir_all(&entry);
        }
        // Fails when a concurrent build of the same shim published its copy first: keep that one.
        if std::fs::rename(&staging, &entry).is_err() {
            let _ = std::fs::remove_dir_all(&staging);
        }
        evict_shim_cache(&shared);
    }
    cc::emit_link_directives(build, &library);
}

/// How many entries of the shim cache a build dir keeps (the most recently used).
const SHIM_CACHE_ENTRIES: usize = 4;

/// `to` as a hard link to `from`, or a copy where a link cannot be made.
fn link_or_copy(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::hard_link(from, to).or_else(|_| std::fs::copy(from, to).map(|_| ()))
}

/// Marks a shim cache entry as used now (its `used` file's modification time).
fn touch_shim_cache_entry(entry: &Path) {
    let _ = std::fs::File::create(entry.join("used"))
        .and_then(|file| file.set_modified(std::time::SystemTime::now()));
}

/// Removes all but the `SHIM_CACHE_ENTRIES` most recently used entries of the shim cache in
/// `shared`, and staging directories of builds stopped a day ago or more.
fn evict_shim_cache(shared: &Path) {
    let Ok(dir) = std::fs::read_dir(shared) else {
        return;
    };
    let modified = |path: &Path| {
        std::fs::metadata(path)
            .and_then(|m| m.modified())
            .unwrap_or(std::time::UNIX_EPOCH)
    };
    let mut entries = Vec::new();
    for path in dir.filter_map(|entry| entry.ok().map(|e| e.path())) {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if !name.starts_with("speedkit-shim.") {
            continue;
        }
        if name.ends_with(".partial") {
            let age = modified(&path).elapsed().unwrap_or_default();
            if age > std::time::Duration::from_secs(24 * 60 * 60) {
                let _ = std::fs::remove_dir_all(&path);
            }
        } else {
            entries.push((modified(&path.join("used")), path));
        }
    }
    entries.sort_by_key(|(used, _)| std::cmp::Reverse(*used));
    for (_, path) in entries.into_iter().skip(SHIM_CACHE_ENTRIES) {
        let _ = std::fs::remove_dir_all(&path);
    }
}

/// `<build-dir>/<profile>/build`, the parent of the build-script directories, for the OUT_DIR
/// `<build-dir>/[<target>/]<profile>/build/speedkit-<hash>/out`: with `--target` (which trybuild
/// passes) cargo puts OUT_DIRs one level down, under the target's name, and the cache is shared
/// with builds without it.
fn shared_build_dir(out_dir: &Path) -> Option<PathBuf> {
    let build = out_dir
        .ancestors()
        .skip(1)
        .find(|dir| dir.file_name().is_some_and(|name| name == "build"))?;
    let profile_dir = build.parent()?;
    let profile = profile_dir.file_name()?;
    let mut root = profile_dir.parent()?;
    let target = env::var_os("TARGET");
    if target.is_some() && root.file_name() == target.as_deref() {
        root = root.parent()?;
    }
    Some(root.join(profile).join("build"))
}

/// The shim cache's key for this build of the shim, and a readable list of what it hashes: the
/// compiler (its path, `--version` and the full argument list `cc` gives it, which has the
/// optimisation and debug flags, the target's flags, every define and include directory, `CXXFLAGS`;
/// OUT_DIR, where the generated kernel table is, written as `$OUT_DIR`), the environment variables
/// the compiler reads, the archiver and its flags, every file under `shim/` and `kernels/`, the
/// generated kernel table, and the files that identify the headers from outside speedkit
/// (`external_headers`). cargo's OPT_LEVEL and DEBUG count through the flags `cc` makes of them.
fn shim_cache_key(
    build: &cc::Build,
    out_dir: &Path,
    external_headers: &[PathBuf],
) -> (String, String) {
    let mut inputs = String::from("speedkit shim cache 2\n");
    let mut line = |name: &str, value: &str| {
        inputs.push_str(name);
        inputs.push_str(": ");
        inputs.push_str(&value.replace('\n', "\n  "));
        inputs.push('\n');
    };
    let out = out_dir.to_string_lossy();
    let compiler = build.get_compiler();
    line("compiler", &compiler.path().to_string_lossy());
    let version = std::process::Command::new(compiler.path())
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|e| format!("unknown ({e})"));
    line("compiler --version", &version);
    for arg in compiler.args() {
        line(
            "arg",
            &arg.to_string_lossy().replace(out.as_ref(), "$OUT_DIR"),
        );
    }
    for (name, value) in compiler.get_envs() {
        line(
            &format!("compiler env {}", name.to_string_lossy()),
            &value.to_string_lossy(),
        );
    }
    let archiver = build.get_archiver();
    line("archiver", &archiver.get_program().to_string_lossy());
    for arg in archiver.get_args() {
        line("archiver arg", &arg.to_string_lossy());
    }
    for name in [
        "TARGET",
        "HOST",
        "CPATH",
        "C_INCLUDE_PATH",
        "CPLUS_INCLUDE_PATH",
        "COMPILER_PATH",
        "GCC_EXEC_PREFIX",
        "SOURCE_DATE_EPOCH",
    ] {
        let value = env::var_os(name).map(|v| v.to_string_lossy().into_owned());
        line(
            &format!("env {name}"),
            value.as_deref().unwrap_or("(unset)"),
        );
    }
    let mut files = Vec::new();
    for dir in ["shim", "kernels"] {
        files_under(Path::new(dir), &mut files);
    }
    files.sort();
    files.push(out_dir.join("kernel_sources.inc"));
    // The units' files, which say what each unit includes.
    files.extend(
        build
            .get_files()
            .filter(|file| file.starts_with(out_dir))
            .map(Path::to_path_buf),
    );
    files.extend(external_headers.iter().cloned());
    for file in &files {
        let name = file.to_string_lossy().replace(out.as_ref(), "$OUT_DIR");
        match std::fs::read(file) {
            Ok(bytes) => line(&format!("file {name}"), &hash_hex(&bytes)),
            Err(_) => line(&format!("file {name}"), "(absent)"),
        }
    }
    (hash_hex(inputs.as_bytes()), inputs)
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for path in entries.filter_map(|entry| entry.ok().map(|e| e.path())) {
        if path.is_dir() {
            files_under(&path, files);
        } else {
            files.push(path);
        }
    }
}

/// A 128-bit hash of `bytes` in hex: two SipHash passes with different prefixes (std's hasher,
/// stable for a given toolchain, which a build dir has one of).
fn hash_hex(bytes: &[u8]) -> String {
    use std::hash::{DefaultHasher, Hasher};
    let [high, low] = [0u8, 1].map(|seed| {
        let mut hasher = DefaultHasher::new();
        hasher.write_u8(seed);
        hasher.write(bytes);
        hasher.finish()
    });
    format!("{high:016x}{low:016x}")
}
