//! Every kernel file compiles with NVRTC for the architectures speedkit supports. Runs without a GPU
//! (NVRTC ships in the torch wheel), so a kernel that does not compile fails CI.

use speedkit::kernels::{self, Arch};

const AMPERE: Arch = Arch { major: 8, minor: 0 };
const HOPPER: Arch = Arch { major: 9, minor: 0 };

fn compiles_every_file_for(arch: Arch) {
    let files = kernels::files().expect("the kernel table is embedded");
    assert!(!files.is_empty());
    for file in files {
        match kernels::compile(&file, arch) {
            Ok(bytes) => assert!(bytes > 0, "{file} compiled to an empty cubin for {arch}"),
            Err(e) => panic!("{file} does not compile for {arch}: {e}"),
        }
    }
}

#[test]
fn every_kernel_compiles_for_sm_80() {
    compiles_every_file_for(AMPERE);
}

#[test]
fn every_kernel_compiles_for_sm_90() {
    compiles_every_file_for(HOPPER);
}

#[test]
fn kernel_files_include_layernorm() {
    let files = kernels::files().expect("the kernel table is embedded");
    assert!(files.iter().any(|f| f == "layernorm.cuh"), "{files:?}");
}

#[test]
fn nvrtc_is_found_next_to_libtorch() {
    let (major, _) = kernels::nvrtc_version().expect("NVRTC from the torch wheel");
    assert!(major >= 12);
}

#[test]
fn compiling_an_unknown_file_names_it() {
    let err = kernels::compile("no_such_op.cuh", AMPERE).unwrap_err();
    assert!(err.to_string().contains("no_such_op.cuh"), "{err}");
}

#[test]
fn kernels_do_not_run_on_the_cpu() {
    let why = kernels::unavailable_reason(tch::Device::Cpu).expect("a reason, not an error");
    assert!(why.is_some_and(|w| w.contains("CUDA")));
}

#[test]
fn kernel_files_include_the_fp8_cast() {
    let files = kernels::files().expect("the kernel table is embedded");
    assert!(files.iter().any(|f| f == "fp8_cast.cuh"), "{files:?}");
}

#[test]
fn kernel_files_include_the_bias_gelu() {
    let files = kernels::files().expect("the kernel table is embedded");
    assert!(files.iter().any(|f| f == "bias_gelu.cuh"), "{files:?}");
}
