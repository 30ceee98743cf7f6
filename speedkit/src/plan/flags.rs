//! The global flags a [`Plan`] sets, each carrying the reason of the decision behind it.

use super::Plan;
use crate::flags::{Flag, FlagSetting, FlagValue};
use crate::kernels;
use crate::overrides::Override;

impl Plan {
    /// The global flags this plan sets, each with its reason, in the order they are applied.
    pub fn flag_settings(&self) -> Vec<FlagSetting> {
        let mut out = Vec::new();
        let reason = |key: &str| {
            self.decisions
                .iter()
                .find(|d| d.key == key)
                .map_or_else(String::new, |d| d.reason.clone())
        };
        let mut push_bool = |flag: Flag, value: Option<bool>, key: &str| {
            if let Some(v) = value {
                out.push(FlagSetting::new(flag, FlagValue::Bool(v), reason(key)));
            }
        };
        push_bool(Flag::CudnnEnabled, self.cudnn_enabled, "cudnn.enabled");
        push_bool(
            Flag::CudnnBenchmark,
            self.cudnn_benchmark,
            "cudnn.benchmark",
        );
        push_bool(
            Flag::CudnnAllowTf32,
            self.cudnn_allow_tf32,
            "cudnn.allow_tf32",
        );
        push_bool(
            Flag::CudnnDeterministic,
            self.cudnn_deterministic,
            "cudnn.deterministic",
        );
        push_bool(
            Flag::DeterministicAlgorithms,
            self.deterministic_algorithms,
            "deterministic",
        );
        push_bool(
            Flag::CudaExpandableSegments,
            self.cuda_expandable_segments,
            "cuda.expandable_segments",
        );
        let rpr = self.reduced_precision_reduction;
        push_bool(
            Flag::CudaMatmulAllowBf16ReducedPrecisionReduction,
            rpr,
            "reduced_precision_reduction",
        );
        push_bool(
            Flag::CudaMatmulAllowFp16ReducedPrecisionReduction,
            rpr,
            "reduced_precision_reduction",
        );
        // Only backends the config turns off are touched: PyTorch enables all of them by default.
        let sdp = [
            (Flag::SdpFlash, self.sdp.flash),
            (Flag::SdpMemEfficient, self.sdp.mem_efficient),
            (Flag::SdpMath, self.sdp.math),
            (Flag::SdpCudnn, self.sdp.cudnn),
        ];
        for (flag, enabled) in sdp {
            if !enabled {
                push_bool(flag, Some(false), "sdp_backend");
            }
        }
        if let Some(p) = self.matmul_precision {
            // One setter, as `torch.set_float32_matmul_precision` does: it moves the legacy field and
            // the CUDA and oneDNN matmul entries together, and `allow_tf32` (a view of the CUDA entry)
            // follows. Setting `allow_tf32` as well would write the legacy field a second time and, with
            // `medium`, leave the two APIs disagreeing, which PyTorch's getters refuse.
            out.push(FlagSetting::new(
                Flag::Float32MatmulPrecision,
                FlagValue::MatmulPrecision(p),
                reason("tf32_matmul_precision"),
            ));
        }
        // Always set, also to its default: a context on another thread that runs the other setting
        // is then refused by the thread rule instead of switching the kernels under this one.
        out.push(FlagSetting::new(
            kernels::flag(),
            FlagValue::Bool(self.kernels),
            reason("kernels"),
        ));
        // Always set too, for the same reason: off is a registration removed (or none made).
        for o in Override::ALL {
            out.push(FlagSetting::new(
                o.flag(),
                FlagValue::Bool(self.overrides.contains(&o)),
                reason("overrides"),
            ));
        }
        out
    }
}
