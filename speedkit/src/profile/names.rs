//! Kernel and op names: shortened for a table, and sorted into the categories a person asks about
//! ("how much of my step is GEMM, how much is attention, ...").

use serde::Serialize;
use std::fmt;

/// What a kernel (or CPU op) does, judged by its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Matrix multiplications and convolutions (cuBLAS incl. its `nvjet` kernels, CUTLASS, cuDNN conv).
    Gemm,
    /// Fused attention (flash, memory-efficient, cuDNN SDPA).
    Attention,
    /// Layer/batch/group/RMS normalisation.
    Normalisation,
    /// Pointwise kernels: activations, adds, multiplies, fills.
    Elementwise,
    /// Reductions: sums, softmax, losses, sorts.
    Reduction,
    /// Optimizer and GradScaler updates (fused AdamW, multi-tensor `_foreach_` kernels).
    Optimizer,
    /// Memory copies, fills and dtype casts.
    Copy,
    /// Collectives between ranks: NCCL's kernels, and c10d's and Gloo's ops on the CPU.
    Communication,
    /// Everything else (embedding lookups, indexing, ...).
    Other,
}

impl Category {
    /// Every category, in table order.
    pub const ALL: [Category; 9] = [
        Category::Gemm,
        Category::Attention,
        Category::Normalisation,
        Category::Elementwise,
        Category::Reduction,
        Category::Optimizer,
        Category::Copy,
        Category::Communication,
        Category::Other,
    ];

    /// The category of a kernel or op name (its full, unshortened name).
    ///
    /// ```
    /// use speedkit::profile::Category;
    /// assert_eq!(Category::of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"), Category::Gemm);
    /// assert_eq!(Category::of("aten::layer_norm"), Category::Normalisation);
    /// assert_eq!(Category::of("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"), Category::Communication);
    /// ```
    pub fn of(name: &str) -> Category {
        let lower = name.to_ascii_lowercase();
        let has = |patterns: &[&str]| patterns.iter().any(|p| lower.contains(p));
        // Order matters: a cuDNN attention kernel also says "wgmma", a layer-norm kernel also
        // says "norm", an autocast cast is an "elementwise_kernel" running a copy, an NCCL
        // all-reduce says "reduce".
        if has(&["nccl", "c10d::", "gloo"]) {
            Category::Communication
        } else if has(&[
            "adam",
            "multi_tensor_apply",
            "_foreach_",
            "amp_update_scale",
            "amp_foreach",
            "amp_non_finite",
            "sgd",
        ]) {
            Category::Optimizer
        } else if has(&["flash", "fmha", "attention", "sdpa", "scaled_dot_product"]) {
            Category::Attention
        } else if has(&[
            "layer_norm",
            "layernorm",
            "batch_norm",
            "batchnorm",
            "group_norm",
            "groupnorm",
            "rms_norm",
            "rmsnorm",
            "gammabeta",
            "bn_fw",
            "bn_bw",
            "welford",
        ]) {
            Category::Normalisation
        } else if has(&[
            "gemm",
            "gemv",
            "nvjet",
            "cutlass",
            "cublas",
            "xmma",
            "matmul",
            "addmm",
            "aten::mm",
            "bmm",
            "aten::linear",
            "conv",
            "winograd",
            "dgrad",
            "wgrad",
            "splitk",
            "dot_kernel",
        ]) {
            Category::Gemm
        } else if has(&[
            "memcpy",
            "memset",
            "copy",
            "catarray",
            "aten::cat",
            "aten::to",
            "contiguous",
        ]) {
            Category::Copy
        } else if has(&[
            "reduce",
            "softmax",
            "nll_loss",
            "cross_entropy",
            "cub::",
            "scan",
            "sort",
            "topk",
            "argmax",
            "aten::sum",
            "aten::mean",
            "norm",
        ]) {
            Category::Reduction
        } else if has(&[
            "elementwise",
            "pointwise",
            "vectorized",
            "unrolled",
            "gelu",
            "relu",
            "silu",
            "tanh",
            "sigmoid",
            "dropout",
            "fill",
            "zero_",
            "where",
            "aten::add",
            "aten::mul",
            "aten::div",
            "aten::sub",
            "clamp",
        ]) {
            Category::Elementwise
        } else {
            Category::Other
        }
    }

    /// The name shown in tables.
    pub fn label(self) -> &'static str {
        match self {
            Category::Gemm => "GEMM",
            Category::Attention => "attention",
            Category::Normalisation => "normalisation",
            Category::Elementwise => "elementwise",
            Category::Reduction => "reduction",
            Category::Optimizer => "optimizer",
            Category::Copy => "copy",
            Category::Communication => "communication",
            Category::Other => "other",
        }
    }
}

impl fmt::Display for Category {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// A CUDA kernel's demangled name made readable: no return type, parameter list, namespaces or
/// template arguments, except one hint from the template arguments that says which operation a
/// generic kernel ran (its functor, or the first type that is not a plain number type).
///
/// ```
/// use speedkit::profile::shorten_kernel_name;
/// assert_eq!(
///     shorten_kernel_name("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)"),
///     "vectorized_elementwise_kernel<CUDAFunctor_add>",
/// );
/// assert_eq!(shorten_kernel_name("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_tn"), "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_tn");
/// ```
pub fn shorten_kernel_name(name: &str) -> String {
    let name = name.trim();
    if !name.contains('<') && !name.contains("::") {
        // Already flat: cuBLAS/CUTLASS names, `Memcpy HtoD (Pageable -> Device)`.
        return name.to_string();
    }
    let name = name.strip_prefix("void ").unwrap_or(name);
    let (head, template_args) = split_head(name);
    let base = last_path_component(head);
    match template_hint(template_args) {
        Some(hint) => format!("{base}<{hint}>"),
        None => base.to_string(),
    }
}

/// Splits `ns::kernel<args>(params)` into `ns::kernel` and `args` (empty without a template),
/// skipping the brackets of `(anonymous namespace)` and of lambdas inside the path.
fn split_head(name: &str) -> (&str, &str) {
    for (i, c) in name.char_indices() {
        match c {
            '(' if name[i..].starts_with("(anonymous namespace)") => {}
            '(' => return (&name[..i], ""),
            '<' => return (&name[..i], &name[i + 1..matching_angle(name, i)]),
            _ => {}
        }
    }
    (name, "")
}

/// The index of the `>` closing the `<` at `open` (or the end of the string).
fn matching_angle(name: &str, open: usize) -> usize {
    let mut depth = 0usize;
    for (i, c) in name[open..].char_indices() {
        match c {
            '<' => depth += 1,
            '>' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return open + i;
                }
            }
            _ => {}
        }
    }
    name.len()
}

fn last_path_component(path: &str) -> &str {
    let path = path.trim();
    path.rsplit("::").next().unwrap_or(path).trim()
}

/// The operation a generic kernel's template arguments name: the last functor or reduction-op
/// identifier (`…Functor…`, `…functor…`, `…Ops`: the innermost functor of a nested elementwise
/// kernel, a reduction's `sum_functor` or `MeanOps`), else the first identifier that is not a
/// number type, a count or a helper of the kernel machinery.
fn template_hint(args: &str) -> Option<String> {
    const PLAIN: &[&str] = &[
        "float",
        "double",
        "int",
        "long",
        "unsigned",
        "char",
        "bool",
        "short",
        "signed",
        "Half",
        "BFloat16",
        "half",
        "bfloat16",
        "Array",
        "OffsetCalculator",
        "LoadWithoutCast",
        "StoreWithoutCast",
        "LoadWithCast",
        "StoreWithCast",
        "TrivialOffsetCalculator",
        "anonymous",
        "namespace",
        "lambda",
        "const",
        "true",
        "false",
        "BinaryFunctor",
        "AUnaryFunctor",
        "BUnaryFunctor",
        "gpu_kernel_impl",
        "gpu_kernel_impl_nocast",
    ];
    let identifiers: Vec<&str> = args
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|t| !t.is_empty() && !t.starts_with(|c: char| c.is_ascii_digit()))
        .collect();
    let useful = |t: &&str| !PLAIN.contains(t) && !is_namespace_word(t);
    identifiers
        .iter()
        .rev()
        .find(|t| names_an_operation(t) && useful(t))
        .or_else(|| identifiers.iter().find(|t| useful(t)))
        .map(|t| t.to_string())
}

/// Whether a template argument is the functor or reduction op that says what a generic kernel
/// computes.
fn names_an_operation(word: &str) -> bool {
    word.contains("Functor") || word.contains("functor") || word.ends_with("Ops")
}

/// Path components that are namespaces, not operations.
fn is_namespace_word(word: &str) -> bool {
    matches!(
        word,
        "at" | "native" | "detail" | "c10" | "std" | "cuda" | "cub" | "void" | "memory"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elementwise_kernels_keep_their_functor() {
        let name = "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > const&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > const&)::{lambda(int)#1})";
        assert_eq!(shorten_kernel_name(name), "elementwise_kernel<MulFunctor>");
    }

    #[test]
    fn reductions_keep_the_operation_they_reduce_with() {
        let sum = "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4, 4>)";
        let mean = "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, unsigned int, float, 4, 4>)";
        assert_eq!(shorten_kernel_name(sum), "reduce_kernel<sum_functor>");
        assert_eq!(shorten_kernel_name(mean), "reduce_kernel<MeanOps>");
    }

    #[test]
    fn anonymous_namespaces_and_number_types_are_dropped() {
        let name = "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)";
        assert_eq!(
            shorten_kernel_name(name),
            "cunn_SoftMaxForward<SoftMaxForwardEpilogue>"
        );
    }

    #[test]
    fn plain_kernels_keep_their_name() {
        assert_eq!(
            shorten_kernel_name("void at::native::vectorized_layer_norm_kernel<float, float>(int, float, float const*, float const*, float const*, float*, float*, float*)"),
            "vectorized_layer_norm_kernel"
        );
        assert_eq!(
            shorten_kernel_name("Memcpy DtoD (Device -> Device)"),
            "Memcpy DtoD (Device -> Device)"
        );
    }

    #[test]
    fn cutlass_kernels_keep_their_configuration() {
        let name = "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8>(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8::Params)";
        assert_eq!(
            shorten_kernel_name(name),
            "Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8>"
        );
    }

    #[test]
    fn kernels_are_classified_by_name() {
        let cases = [
            ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas", Category::Gemm),
            ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", Category::Gemm),
            ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t> >(Flash_fwd_params)", Category::Attention),
            ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<...>::Params)", Category::Attention),
            ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0", Category::Attention),
            ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(int, float, c10::BFloat16 const*)", Category::Normalisation),
            ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2> >(int, ...)", Category::Elementwise),
            ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4, 4> >(...)", Category::Reduction),
            ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)", Category::Reduction),
            ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<5>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 5, (at::native::ADAM_MODE)1, false>, float*, double, double, double, double, double, bool, float const*, float const*>(...)", Category::Optimizer),
            ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, at::detail::Array<char*, 2>, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(...)", Category::Copy),
            ("Memset (Device)", Category::Copy),
            ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", Category::Communication),
            ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", Category::Communication),
            ("c10d::allreduce_", Category::Communication),
            ("void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>(...)", Category::Other),
            ("aten::addmm", Category::Gemm),
            ("aten::mm", Category::Gemm),
            ("aten::scaled_dot_product_attention", Category::Attention),
            ("aten::_fused_adamw_", Category::Optimizer),
            ("aten::copy_", Category::Copy),
            ("aten::sum", Category::Reduction),
            ("aten::mul", Category::Elementwise),
            ("aten::embedding", Category::Other),
        ];
        for (name, expected) in cases {
            assert_eq!(Category::of(name), expected, "{name}");
        }
    }
}
