//! Gives the examples, tests and benches of this package an rpath to libtorch, so they run without
//! `LD_LIBRARY_PATH` — the same one call the guide (docs/guide/your-own-crate.md) asks of a
//! user's crate — and tells `tests/user_crate.rs` which libtorch that is, so the crate it builds
//! uses the same one.

fn main() {
    let lib_dir = speedkit_build::link_libtorch_rpath();
    println!(
        "cargo:rustc-env=SPEEDKIT_LIBTORCH_LIB={}",
        lib_dir.display()
    );
}
