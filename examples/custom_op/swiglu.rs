//! The fused SwiGLU of `examples/custom_op`: its CUDA kernels, their declarations, the autograd
//! function around them and the op a model calls. `tests/gpu_custom_op.rs` tests it against tch's
//! composite.

use std::sync::{Arc, OnceLock};

use speedkit::cuda::{Arg, CudaKernel, CudaModule, Param};
use speedkit::function::{apply, BackwardContext, ForwardContext, Function};
use tch::{Device, Kind, Tensor};

/// The kernels. `x` is `[rows, 2·hidden]` (a then b, side by side, as one Linear writes them),
/// `y` and `dy` are `[rows, hidden]`; the arithmetic is fp32 whatever the storage type.
pub const SOURCE: &str = r#"
#include "common.cuh"

template <typename T>
__device__ void swiglu_forward(const T* x, T* y, long long rows, int hidden) {
  const long long groups = rows * (hidden / 8);
  const bool vector = hidden % 8 == 0;
  const long long n = vector ? groups : rows * hidden;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    if (vector) {
      const long long row = i / (hidden / 8), col = (i % (hidden / 8)) * 8;
      float a[8], b[8], out[8];
      sk::load8(x + row * 2 * hidden + col, a);
      sk::load8(x + row * 2 * hidden + hidden + col, b);
      for (int k = 0; k < 8; ++k) out[k] = a[k] / (1.f + __expf(-a[k])) * b[k];
      sk::store8(y + row * hidden + col, out);
    } else {
      const long long row = i / hidden, col = i % hidden;
      const float a = sk::to_float(x[row * 2 * hidden + col]), b = sk::to_float(x[row * 2 * hidden + hidden + col]);
      y[i] = sk::from_float<T>(a / (1.f + __expf(-a)) * b);
    }
  }
}

// d silu(a) / da = s (1 + a (1 - s)), s = sigmoid(a)
template <typename T>
__device__ void swiglu_backward(const T* dy, const T* x, T* dx, long long rows, int hidden) {
  const long long groups = rows * (hidden / 8);
  const bool vector = hidden % 8 == 0;
  const long long n = vector ? groups : rows * hidden;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    if (vector) {
      const long long row = i / (hidden / 8), col = (i % (hidden / 8)) * 8;
      float g[8], a[8], b[8], da[8], db[8];
      sk::load8(dy + row * hidden + col, g);
      sk::load8(x + row * 2 * hidden + col, a);
      sk::load8(x + row * 2 * hidden + hidden + col, b);
      for (int k = 0; k < 8; ++k) {
        const float s = 1.f / (1.f + __expf(-a[k]));
        da[k] = g[k] * b[k] * s * (1.f + a[k] * (1.f - s));
        db[k] = g[k] * a[k] * s;
      }
      sk::store8(dx + row * 2 * hidden + col, da);
      sk::store8(dx + row * 2 * hidden + hidden + col, db);
    } else {
      const long long row = i / hidden, col = i % hidden;
      const float g = sk::to_float(dy[i]);
      const float a = sk::to_float(x[row * 2 * hidden + col]), b = sk::to_float(x[row * 2 * hidden + hidden + col]);
      const float s = 1.f / (1.f + __expf(-a));
      dx[row * 2 * hidden + col] = sk::from_float<T>(g * b * s * (1.f + a * (1.f - s)));
      dx[row * 2 * hidden + hidden + col] = sk::from_float<T>(g * a * s);
    }
  }
}

#define ENTRY(tag, T)                                                                                  \
  extern "C" __global__ void swiglu_forward_##tag(const T* x, T* y, long long rows, int hidden) {    \
    swiglu_forward<T>(x, y, rows, hidden);                                                          \
  }                                                                                                  \
  extern "C" __global__ void swiglu_backward_##tag(const T* dy, const T* x, T* dx, long long rows,   \
                                                   int hidden) {                                    \
    swiglu_backward<T>(dy, x, dx, rows, hidden);                                                    \
  }
ENTRY(f32, float)
ENTRY(bf16, sk::bf16)
ENTRY(f16, sk::f16)
"#;

/// The forward and backward kernels for one storage type on one device.
struct SwiGluKernels {
    forward: CudaKernel,
    backward: CudaKernel,
}

impl SwiGluKernels {
    /// Compiled and loaded once per (device, type): the first call compiles with NVRTC (or reads
    /// speedkit's on-disk cache), later ones are a lookup.
    fn get(device: Device, kind: Kind) -> speedkit::Result<Arc<SwiGluKernels>> {
        type Loaded = std::sync::Mutex<Vec<((Device, Kind), Arc<SwiGluKernels>)>>;
        static LOADED: OnceLock<Loaded> = OnceLock::new();
        let loaded = LOADED.get_or_init(Default::default);
        let mut loaded = loaded.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, k)) = loaded.iter().find(|(key, _)| *key == (device, kind)) {
            return Ok(Arc::clone(k));
        }
        let tag = match kind {
            Kind::BFloat16 => "bf16",
            Kind::Half => "f16",
            _ => "f32",
        };
        let module = CudaModule::new("swiglu.cu", SOURCE)?;
        let t = Param::Tensor(kind);
        let kernels = Arc::new(SwiGluKernels {
            forward: module.kernel(
                &format!("swiglu_forward_{tag}"),
                &[t, t, Param::I64, Param::I32],
                device,
            )?,
            backward: module.kernel(
                &format!("swiglu_backward_{tag}"),
                &[t, t, t, Param::I64, Param::I32],
                device,
            )?,
        });
        loaded.push(((device, kind), Arc::clone(&kernels)));
        Ok(kernels)
    }

    /// A grid-stride grid: enough blocks of 256 threads to cover `n` threads, at most 8 per SM.
    fn grid(n: i64) -> u32 {
        ((n + 255) / 256).clamp(1, 132 * 8) as u32
    }
}

/// The autograd function around the two kernels.
struct SwiGlu {
    kernels: Arc<SwiGluKernels>,
}

impl Function for SwiGlu {
    fn forward(
        &mut self,
        ctx: &mut ForwardContext<'_>,
        inputs: &[Tensor],
    ) -> speedkit::Result<Vec<Tensor>> {
        let x = inputs[0].contiguous();
        let (rows, hidden) = rows_and_hidden(&x);
        let y = Tensor::empty([rows, hidden], (x.kind(), x.device()));
        let threads = if hidden % 8 == 0 {
            rows * hidden / 8
        } else {
            rows * hidden
        };
        self.kernels.forward.launch(
            SwiGluKernels::grid(threads),
            256,
            0,
            &[
                (&x).into(),
                (&y).into(),
                Arg::I64(rows),
                Arg::I32(hidden as i32),
            ],
        )?;
        ctx.save_for_backward(&[&x])?;
        Ok(vec![y.view(out_shape(&inputs[0]).as_slice())])
    }

    fn backward(
        &mut self,
        ctx: &mut BackwardContext<'_>,
        grads: &[Option<Tensor>],
    ) -> speedkit::Result<Vec<Option<Tensor>>> {
        let x = ctx.saved()?.remove(0);
        let (rows, hidden) = rows_and_hidden(&x);
        let dy = grads[0].as_ref().map_or_else(
            || Tensor::zeros([rows, hidden], (x.kind(), x.device())),
            |g| g.to_kind(x.kind()).contiguous(),
        );
        let dx = Tensor::empty_like(&x);
        let threads = if hidden % 8 == 0 {
            rows * hidden / 8
        } else {
            rows * hidden
        };
        self.kernels.backward.launch(
            SwiGluKernels::grid(threads),
            256,
            0,
            &[
                (&dy).into(),
                (&x).into(),
                (&dx).into(),
                Arg::I64(rows),
                Arg::I32(hidden as i32),
            ],
        )?;
        Ok(vec![Some(dx)])
    }
}

fn rows_and_hidden(x: &Tensor) -> (i64, i64) {
    let width = x.size().last().copied().unwrap_or(0);
    (x.numel() as i64 / width.max(1), width / 2)
}

fn out_shape(x: &Tensor) -> Vec<i64> {
    let mut shape = x.size();
    if let Some(last) = shape.last_mut() {
        *last /= 2;
    }
    shape
}

/// tch's composite, the reference and the CPU's path.
pub fn swiglu_composite(x: &Tensor) -> Tensor {
    let halves = x.chunk(2, -1);
    halves[0].silu() * &halves[1]
}

/// SwiGLU of `x` (`[.., 2·hidden]`): the fused kernels on a CUDA device (fp32, bf16, fp16), tch's
/// composite anywhere else.
pub fn swiglu(x: &Tensor) -> speedkit::Result<Tensor> {
    let fused = matches!(x.device(), Device::Cuda(_))
        && matches!(x.kind(), Kind::Float | Kind::BFloat16 | Kind::Half);
    if !fused {
        return Ok(swiglu_composite(x));
    }
    let kernels = SwiGluKernels::get(x.device(), x.kind())?;
    Ok(apply(SwiGlu { kernels }, &[x])?.remove(0))
}
