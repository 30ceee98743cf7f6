//! The build-script side of using [speedkit](https://example.invalid/speedkit) in your own crate.
//!
//! An executable that links libtorch must find `libtorch_cpu.so` (and its siblings) when it
//! starts. speedkit's own build script knows where libtorch is (the directory torch-sys linked
//! against), but it cannot give *your* executables an rpath: cargo applies
//! `cargo:rustc-link-arg` only to the targets of the package whose build script prints it, never
//! to its dependents (torch-sys's build script says the same of its own attempt). So the package
//! that owns the executables — yours — prints it, in one call from the `main` of its `build.rs`:
//!
//! ```no_run
//! speedkit_build::link_libtorch_rpath();
//! ```
//!
//! with, in `Cargo.toml`, `speedkit` under `[dependencies]` and `speedkit-build` under
//! `[build-dependencies]`. Every binary, example, test and bench of the package then runs without
//! `LD_LIBRARY_PATH`. This crate has no dependencies and does not build libtorch twice: it only
//! reads what speedkit's build script published.

#![warn(missing_docs)]

pub mod abi;

use std::env;
use std::path::PathBuf;

/// The variable through which speedkit's build script (`links = "speedkit_shim"`, key
/// `libtorch_lib`) tells the build scripts of the packages that depend on it directly where
/// libtorch's libraries are.
pub const LIBTORCH_LIB_VAR: &str = "DEP_SPEEDKIT_SHIM_LIBTORCH_LIB";

/// Gives every executable of the calling package an rpath to the libtorch that speedkit was built
/// against, and returns that directory (`<libtorch>/lib`).
///
/// Call it from the package's `build.rs`. Nothing is printed on Windows, where libraries are
/// found through `PATH` and there is no rpath.
///
/// When speedkit is not a direct dependency of the package, cargo does not pass speedkit's
/// metadata to the build script; the build then stops with a message saying so (a build script
/// has no better channel for an error than its exit status and stderr).
///
/// ```no_run
/// let lib_dir = speedkit_build::link_libtorch_rpath();
/// assert!(lib_dir.join("libtorch_cpu.so").exists() || lib_dir.join("torch_cpu.dll").exists());
/// ```
pub fn link_libtorch_rpath() -> PathBuf {
    println!("cargo:rerun-if-env-changed={LIBTORCH_LIB_VAR}");
    let Some(lib_dir) = env::var_os(LIBTORCH_LIB_VAR).map(PathBuf::from) else {
        eprintln!(
            "speedkit_build::link_libtorch_rpath: {LIBTORCH_LIB_VAR} is not set. cargo passes it \
             only to the build script of a package that lists `speedkit` under [dependencies] \
             itself; add it there (next to speedkit-build under [build-dependencies])."
        );
        std::process::exit(1);
    };
    let target_family = env::var("CARGO_CFG_TARGET_FAMILY").unwrap_or_default();
    if target_family.split(',').any(|family| family == "unix") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    }
    lib_dir
}
