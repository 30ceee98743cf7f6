//! Gives the examples, tests and benches of this package an rpath to libtorch, so they run without
//! `LD_LIBRARY_PATH`. speedkit's build script (`links = "speedkit_shim"`) publishes the directory.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_SPEEDKIT_SHIM_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_SPEEDKIT_SHIM_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    }
}
