//! Every kernel file compiles with NVRTC for the architectures speedkit supports. Runs without a GPU
//! (NVRTC ships in the torch wheel), so a kernel that does not compile fails CI.

use speedkit::cuda::CudaModule;
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
fn one_entry_point_compiles_without_the_rest_of_its_file() {
    let whole = kernels::compile("batch_norm.cuh", HOPPER).expect("the file compiles");
    let one = kernels::compile_entry_point("batch_norm.cuh", "batch_norm_backward_finish", HOPPER)
        .expect("its entry point compiles alone");
    // The file holds 37 entry points; one of them alone is a small part of its cubin.
    assert!(one > 0 && one * 4 < whole, "{one} bytes of {whole}");
}

#[test]
fn entry_points_of_every_kind_compile_alone() {
    for (file, entry) in [
        ("layernorm.cuh", "layernorm_forward_f32_bf16_f32_bf16"),
        ("layernorm.cuh", "layernorm_backward_bf16_f32_bf16_768"),
        ("layernorm.cuh", "layernorm_param_grad_f16"),
        ("fp8_cast.cuh", "fp8_cast_transpose_bf16_e4m3"),
        ("log_softmax.cuh", "log_softmax_nll_backward_f16"),
        ("adamw.cuh", "adamw_with_copy_bf16"),
    ] {
        let bytes = kernels::compile_entry_point(file, entry, HOPPER)
            .unwrap_or_else(|e| panic!("{entry} of {file}: {e}"));
        assert!(bytes > 0, "{entry}");
    }
}

#[test]
fn an_entry_point_its_file_lacks_is_an_error_naming_both() {
    let err = kernels::compile_entry_point("layernorm.cuh", "layernorm_forward_f64", AMPERE)
        .expect_err("there is no fp64 entry point");
    let text = err.to_string();
    assert!(
        text.contains("layernorm.cuh") && text.contains("layernorm_forward_f64"),
        "{text}"
    );
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

#[test]
fn the_overrides_kernels_are_built_in_files() {
    let files = kernels::files().expect("the kernel table is embedded");
    for file in ["batch_norm.cuh", "log_softmax.cuh"] {
        assert!(files.iter().any(|f| f == file), "{file} not in {files:?}");
        let module = CudaModule::built_in(file).expect("a built-in file opens");
        assert_eq!(module.name(), file);
    }
    assert!(kernels::registered()
        .unwrap()
        .iter()
        .all(|f| !f.ends_with(".cuh")));
}

#[test]
fn a_file_that_is_not_built_in_is_refused_by_name() {
    let err = CudaModule::built_in("no_such_op.cuh").unwrap_err();
    assert!(err.to_string().contains("no_such_op.cuh"), "{err}");
}

const SCALE: &str = r#"extern "C" __global__ void scale(float* x, float k, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= k;
}
"#;

#[test]
fn a_source_registered_at_run_time_is_listed_and_compiles() {
    CudaModule::new("test_scale.cu", SCALE).expect("a new source registers");
    assert!(kernels::registered()
        .unwrap()
        .contains(&"test_scale.cu".to_string()));
    assert!(!kernels::files()
        .unwrap()
        .contains(&"test_scale.cu".to_string()));
    let bytes = kernels::compile("test_scale.cu", HOPPER).expect("it compiles");
    assert!(bytes > 0);
}

#[test]
fn registering_the_same_source_again_is_the_same_source() {
    CudaModule::new("test_twice.cu", SCALE).unwrap();
    CudaModule::new("test_twice.cu", SCALE).expect("the same text again is allowed");
    let count = kernels::registered()
        .unwrap()
        .iter()
        .filter(|f| *f == "test_twice.cu")
        .count();
    assert_eq!(count, 1);
}

#[test]
fn a_name_taken_by_other_text_is_refused() {
    CudaModule::new("test_taken.cu", SCALE).unwrap();
    let err = CudaModule::new("test_taken.cu", "// other text\n").unwrap_err();
    assert!(err.to_string().contains("another name"), "{err}");
}

#[test]
fn a_registered_source_can_include_speedkits_own_headers() {
    let source = "#include \"common.cuh\"\nextern \"C\" __global__ void warp_total(float* x) { x[threadIdx.x] = sk::warp_sum(x[threadIdx.x]); }\n";
    CudaModule::new("test_includes.cu", source).unwrap();
    assert!(kernels::compile("test_includes.cu", AMPERE).expect("common.cuh is a header") > 0);
}

#[test]
fn a_source_that_does_not_compile_reports_nvrtcs_log() {
    CudaModule::new(
        "test_broken.cu",
        "extern \"C\" __global__ void broken() { undeclared(); }\n",
    )
    .unwrap();
    let err = kernels::compile("test_broken.cu", HOPPER)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("test_broken.cu") && err.contains("undeclared"),
        "{err}"
    );
}

/// `count` kernel sources of their own, registered under names that start with `prefix`.
fn registered_sources(prefix: &str, count: usize) -> Vec<CudaModule> {
    (0..count)
        .map(|k| {
            let source = format!(
                "extern \"C\" __global__ void {prefix}_{k}(float* x, int n) {{\n\
                 int i = blockIdx.x * blockDim.x + threadIdx.x;\n\
                 if (i < n) x[i] = x[i] * {k}.f + 1.f;\n}}\n"
            );
            CudaModule::new(&format!("{prefix}_{k}.cu"), &source).expect("a new name")
        })
        .collect()
}

#[test]
fn sources_compiled_ahead_on_several_threads_are_each_compiled_once() {
    let modules = registered_sources("ahead_once", 6);
    let first = kernels::compile_ahead(&modules, HOPPER).expect("NVRTC from the torch wheel");
    // The disk cache may hold them from an earlier run of this test.
    assert_eq!(
        (first.compiled + first.cached, first.failed),
        (6, 0),
        "{first}"
    );
    assert!(first.threads >= 1 && first.threads <= kernels::MOST_COMPILE_THREADS);
    let again = kernels::compile_ahead(&modules, HOPPER).expect("compiled already");
    assert_eq!((again.compiled, again.cached), (0, 6), "{again}");
}

#[test]
fn a_source_that_does_not_compile_ahead_is_counted_and_the_rest_compile() {
    let mut modules = registered_sources("ahead_broken", 3);
    modules.push(
        CudaModule::new(
            "ahead_broken_bad.cu",
            "extern \"C\" __global__ void bad(float* x) { x[0] = undeclared; }\n",
        )
        .expect("a new name"),
    );
    let done = kernels::compile_ahead(&modules, HOPPER).expect("the others compile");
    assert_eq!((done.compiled + done.cached, done.failed), (3, 1), "{done}");
    assert!(done.to_string().contains("1 not compiled"), "{done}");
}

#[test]
fn the_same_source_named_twice_is_compiled_ahead_once() {
    let modules = registered_sources("ahead_twice", 1);
    let twice = [modules[0].clone(), modules[0].clone()];
    let done = kernels::compile_ahead(&twice, HOPPER).expect("NVRTC from the torch wheel");
    assert_eq!(done.compiled + done.cached, 1, "{done}");
}

#[test]
fn compiling_ahead_one_of_speedkits_own_files_is_an_error_naming_it() {
    let own = CudaModule::built_in("layernorm.cuh").expect("embedded");
    let err = kernels::compile_ahead(&[own], HOPPER).expect_err("compiled per entry point");
    assert!(err.to_string().contains("layernorm.cuh"), "{err}");
}
