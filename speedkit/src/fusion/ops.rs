//! What each ATen operator is to the fusion planner.

/// The role of an operator in a step's data flow, as Inductor's scheduler sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    /// One output element from the same element of each input (broadcasts, scalars, casts,
    /// activations and their backwards, comparisons, `where`, dropout's mask): a kernel ATen runs
    /// on its own, which a fused kernel runs inline.
    Pointwise,
    /// Reads rows and writes one value per row (sums, means, maxima, a norm's statistics, a
    /// softmax): fusable with the pointwise work that feeds it and with consumers that read the
    /// same rows.
    Reduction,
    /// A new view of the same memory (`view`, `permute`, `narrow`, `expand`, ...): no kernel; index
    /// arithmetic in a fused kernel.
    View,
    /// A layout copy (`clone`, `cat`, `contiguous`, padding, nearest up-sampling): a kernel in
    /// ATen, index arithmetic in a fused one.
    Layout,
    /// A library kernel (GEMM, convolution, attention, embedding): its own kernel, not generated.
    Library,
    /// Memory without values (`empty`, `empty_strided`): no kernel.
    Allocation,
}

impl OpKind {
    /// The kind of operator `name` (such as `aten::mul`), or `None` for one speedkit does not
    /// model yet (it runs ATen's kernel).
    ///
    /// ```
    /// use speedkit::fusion::OpKind;
    /// assert_eq!(OpKind::of("aten::silu_backward"), Some(OpKind::Pointwise));
    /// assert_eq!(OpKind::of("aten::mm"), Some(OpKind::Library));
    /// assert_eq!(OpKind::of("aten::nonzero"), None);
    /// // speedkit's own operator for a bias's gradient (a sum over columns).
    /// assert_eq!(OpKind::of("speedkit::column_sums"), Some(OpKind::Reduction));
    /// // speedkit's convolution (cuDNN plans it chose, or ATen's).
    /// assert_eq!(OpKind::of("speedkit::convolution"), Some(OpKind::Library));
    /// ```
    pub fn of(name: &str) -> Option<OpKind> {
        if SPEEDKIT_REDUCTIONS.contains(&name) {
            return Some(OpKind::Reduction);
        }
        if SPEEDKIT_LIBRARY.contains(&name) {
            return Some(OpKind::Library);
        }
        let op = name.strip_prefix("aten::")?;
        let base = op.strip_suffix('_').unwrap_or(op);
        let kinds: [(&[&str], OpKind); 6] = [
            (POINTWISE, OpKind::Pointwise),
            (REDUCTION, OpKind::Reduction),
            (VIEW, OpKind::View),
            (LAYOUT, OpKind::Layout),
            (LIBRARY, OpKind::Library),
            (ALLOCATION, OpKind::Allocation),
        ];
        kinds
            .iter()
            .find(|(names, _)| names.contains(&op) || names.contains(&base))
            .map(|(_, kind)| *kind)
    }

    /// Whether operator `name` reads its inputs' values: `ones_like` and its kin read only their
    /// input's sizes, so they do not depend on the call that wrote it.
    ///
    /// ```
    /// use speedkit::fusion::OpKind;
    /// assert!(OpKind::reads_values("aten::mul"));
    /// assert!(!OpKind::reads_values("aten::ones_like"));
    /// ```
    pub fn reads_values(name: &str) -> bool {
        let op = name.strip_prefix("aten::").unwrap_or(name);
        !(op.ends_with("_like") || ALLOCATION.contains(&op))
    }

    /// Whether a generated kernel can take it (every kind but library kernels and allocations).
    pub fn fusable(self) -> bool {
        !matches!(self, OpKind::Library | OpKind::Allocation)
    }

    /// Whether ATen runs a kernel for it (views and allocations run none).
    pub fn launches_kernel(self) -> bool {
        !matches!(self, OpKind::View | OpKind::Allocation)
    }
}

// In-place forms (`add_`, `mul_`) are found by their name without the trailing underscore.
const POINTWISE: &[&str] = &[
    "abs",
    "add",
    "addcdiv",
    "addcmul",
    "bitwise_and",
    "bitwise_not",
    "bitwise_or",
    "clamp",
    "clamp_max",
    "clamp_min",
    "copy",
    "cos",
    "div",
    "elu",
    "elu_backward",
    "eq",
    "erf",
    "exp",
    "exp2",
    "expm1",
    "fill",
    "full_like",
    "ge",
    "gelu",
    "gelu_backward",
    "gt",
    "hardtanh",
    "hardtanh_backward",
    "le",
    "leaky_relu",
    "leaky_relu_backward",
    "lerp",
    "log",
    "log1p",
    "log_sigmoid_forward",
    "log_sigmoid_backward",
    "logical_and",
    "logical_not",
    "logical_or",
    "lt",
    "masked_fill",
    "maximum",
    "minimum",
    "mse_loss_backward",
    "mul",
    "native_dropout",
    "native_dropout_backward",
    "ne",
    "neg",
    "nll_loss_backward",
    "ones_like",
    "pow",
    "reciprocal",
    "relu",
    "rsqrt",
    "rsub",
    "sigmoid",
    "sigmoid_backward",
    "sign",
    "silu",
    "silu_backward",
    "sin",
    "softplus",
    "softplus_backward",
    "sqrt",
    "square",
    "sub",
    "tanh",
    "tanh_backward",
    "threshold",
    "threshold_backward",
    "where",
    "zero",
    "zeros_like",
    "_to_copy",
];

/// speedkit's own operators that reduce (`speedkit/shim/column_sums.cpp`): a linear layer's bias
/// gradient, which its backward sums through the dispatcher so that a group can take the sum.
const SPEEDKIT_REDUCTIONS: &[&str] = &["speedkit::column_sums"];

/// speedkit's own library operators (`speedkit/shim/convolution.cpp`): the convolutions of its
/// convolution override, through cuDNN plans it chose or ATen's.
const SPEEDKIT_LIBRARY: &[&str] = &["speedkit::convolution", "speedkit::convolution_backward"];

const REDUCTION: &[&str] = &[
    "amax",
    "amin",
    "any",
    "all",
    "argmax",
    "argmin",
    "linalg_vector_norm",
    "logsumexp",
    "max",
    "mean",
    "min",
    "mse_loss",
    "native_batch_norm",
    "native_batch_norm_backward",
    "native_group_norm",
    "native_group_norm_backward",
    "native_layer_norm",
    "native_layer_norm_backward",
    "nll_loss_forward",
    "norm",
    "prod",
    "std",
    "sum",
    "var",
    "var_mean",
    "_log_softmax",
    "_log_softmax_backward_data",
    "_softmax",
    "_softmax_backward_data",
    "upsample_nearest2d_backward",
    "cudnn_batch_norm",
    "cudnn_batch_norm_backward",
];

// Also the composites that return their input when they have nothing to do (`contiguous`, `to`):
// the trace shows what they did instead as calls under them.
const VIEW: &[&str] = &[
    "alias",
    "as_strided",
    "chunk",
    "conj",
    "contiguous",
    "detach",
    "expand",
    "expand_as",
    "flatten",
    "lift_fresh",
    "narrow",
    "permute",
    "reshape",
    "resolve_conj",
    "resolve_neg",
    "select",
    "slice",
    "split",
    "split_with_sizes",
    "squeeze",
    "t",
    "transpose",
    "unbind",
    "unflatten",
    "unsqueeze",
    "view",
    "view_as",
    "_reshape_alias",
    "_unsafe_view",
    "to",
    "type_as",
    "sum_to_size",
    "reshape_as",
];

const LAYOUT: &[&str] = &[
    "cat",
    "clone",
    "constant_pad_nd",
    "index_select",
    "repeat",
    "stack",
    "upsample_nearest2d",
    "select_backward",
    "slice_backward",
    "embedding",
];

const LIBRARY: &[&str] = &[
    "addmm",
    "baddbmm",
    "bmm",
    "convolution",
    "convolution_backward",
    "cudnn_convolution",
    "embedding_dense_backward",
    "mm",
    "_convolution",
    "_efficient_attention_backward",
    "_efficient_attention_forward",
    "_flash_attention_backward",
    "_flash_attention_forward",
    "_fused_adam",
    "_fused_adamw",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_to_dense",
];

const ALLOCATION: &[&str] = &[
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
];
