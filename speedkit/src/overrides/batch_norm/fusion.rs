//! The deferred normalisation and its fusion: a forward's output pending until its first read,
//! and the `relu` (and the residual `add` before it) that compute their result from the forward's
//! inputs and coefficients in the normalisation's own pass.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tch::{Kind, Tensor};

use super::launch::Layout;
use super::params::Normalize;
use crate::error::Result;
use crate::overrides::producers::Producers;
use crate::overrides::{OverrideCall, Reply};

/// `relu` of a pending output of the forward above (or of an `add` below): the normalisation, the
/// addition and the ReLU in one pass over the inputs, the normalised tensor and the sum never
/// written. Any other call runs ATen's kernel.
pub(super) fn relu(call: &OverrideCall<'_>) -> Result<Reply> {
    let y = call.tensor("self")?;
    let Some(pointwise) = Pointwise::of(y)? else {
        return Ok(Reply::Declined(
            "input not a pending BatchNorm output".into(),
        ));
    };
    if !pointwise.normalized.layout.is_whole(y) {
        return Ok(Reply::Declined("a view of a BatchNorm output".into()));
    }
    Ok(Reply::Ran(vec![pointwise.write(true)?]))
}

/// `add(self, other, alpha=1)` where one side is a pending BatchNorm output and the other a tensor
/// laid out as it, or another pending BatchNorm output (a residual block's sum): the sum pending
/// too, for the `relu` that usually follows. Any other call runs ATen's kernel.
pub(super) fn add(call: &OverrideCall<'_>) -> Result<Reply> {
    let (a, b) = (call.tensor("self")?, call.tensor("other")?);
    let (first, other) = match (Pointwise::of(a)?, Pointwise::of(b)?) {
        (Some(p), _) if p.addend.is_none() => (p, b),
        (_, Some(p)) if p.addend.is_none() => (p, a),
        _ => return Ok(Reply::Declined("no side a pending BatchNorm output".into())),
    };
    let layout = &first.normalized.layout;
    if call.double("alpha")? != 1.0 || !layout.is_whole(a) || !layout.is_whole(b) {
        return Ok(Reply::Declined(
            "a scaled sum, or sides in other shapes, types or layouts".into(),
        ));
    }
    let addend = match Pointwise::of(other)? {
        Some(p) if p.addend.is_none() => Addend::Normalized(Arc::clone(&p.normalized)),
        Some(_) => return Ok(Reply::Declined("a side that is a pending sum".into())),
        None => Addend::Tensor(Mutex::new(other.shallow_clone())),
    };
    let sum = Arc::new(Pointwise {
        normalized: Arc::clone(&first.normalized),
        addend: Some(addend),
    });
    Ok(Reply::Ran(vec![sum.deferred()?]))
}

/// A training-mode forward's input and normalisation coefficients.
pub(super) struct Normalized {
    pub(super) layout: Layout,
    /// The input as a matrix and the coefficients [3, C] (a `Mutex` only to share tensors, which
    /// are not `Sync`).
    pub(super) tensors: Mutex<(Tensor, Tensor)>,
}

impl Normalized {
    fn matrix_and_coefficients(&self) -> (Tensor, Tensor) {
        let tensors = self.tensors.lock().unwrap_or_else(PoisonError::into_inner);
        (tensors.0.shallow_clone(), tensors.1.shallow_clone())
    }
}

/// What a pending output is computed from: a normalisation, plus what an `add` added to it.
pub(super) struct Pointwise {
    normalized: Arc<Normalized>,
    addend: Option<Addend>,
}

/// The other side of a fused `add`.
enum Addend {
    /// A tensor laid out as the normalised input.
    Tensor(Mutex<Tensor>),
    /// Another normalisation.
    Normalized(Arc<Normalized>),
}

impl Pointwise {
    /// The pending output of a forward: deferred (see [`Pointwise::deferred`]).
    pub(super) fn output(normalized: Normalized) -> Result<Tensor> {
        Arc::new(Pointwise {
            normalized: Arc::new(normalized),
            addend: None,
        })
        .deferred()
    }

    /// What the pending output `t` computes from, where it is one of these.
    fn of(t: &Tensor) -> Result<Option<Arc<Pointwise>>> {
        Ok(crate::deferred::tag(t)?.and_then(|tag| pending().find(tag)))
    }

    /// The result, deferred ([`crate::deferred`]): written at its first read, unless that read is
    /// a fused consumer (a `relu`; an `add` of a bare normalisation), which computes from this
    /// instead. Written now where the thread cannot defer (RecordFunction off).
    fn deferred(self: &Arc<Self>) -> Result<Tensor> {
        let layout = &self.normalized.layout;
        let consumers: &[&str] = match self.addend {
            None => &["aten::relu", "aten::add"],
            Some(_) => &["aten::relu"],
        };
        let tag = pending().insert(self);
        let source = Arc::clone(self);
        let deferred = crate::deferred::tagged(
            &[layout.rows, layout.channels],
            layout.kind,
            layout.device,
            consumers,
            tag,
            move |ym| source.launch(ym, false),
        );
        match deferred {
            Ok(ym) => {
                let sources = self.sources();
                crate::deferred::computed_from(&ym, &sources.iter().collect::<Vec<_>>())?;
                layout.unmatrix(&ym)
            }
            Err(_) => self.write(false),
        }
    }

    /// The tensors the output is computed from: each normalisation's input and coefficients, and
    /// an added tensor.
    fn sources(&self) -> Vec<Tensor> {
        let (x, coefficients) = self.normalized.matrix_and_coefficients();
        let mut sources = vec![x, coefficients];
        match &self.addend {
            Some(Addend::Tensor(t)) => sources.push(
                t.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .shallow_clone(),
            ),
            Some(Addend::Normalized(other)) => {
                let (x, coefficients) = other.matrix_and_coefficients();
                sources.extend([x, coefficients]);
            }
            None => {}
        }
        sources
    }

    /// The result (with `relu`, its ReLU) in a new tensor laid out as the input.
    fn write(&self, relu: bool) -> Result<Tensor> {
        let layout = &self.normalized.layout;
        let ym = Tensor::f_empty([layout.rows, layout.channels], (layout.kind, layout.device))?;
        self.launch(&ym, relu)?;
        layout.unmatrix(&ym)
    }

    /// Writes the result matrix [rows, C] into `ym`.
    fn launch(&self, ym: &Tensor, relu: bool) -> Result<()> {
        let layout = &self.normalized.layout;
        let (xm, coefficients) = self.normalized.matrix_and_coefficients();
        let (add, other, other_coefficients) = match &self.addend {
            None => (0, None, None),
            Some(Addend::Tensor(t)) => {
                let t = t.lock().unwrap_or_else(PoisonError::into_inner);
                (1, Some(layout.matrix(&t)?), None)
            }
            Some(Addend::Normalized(n)) => {
                let (other, other_coefficients) = n.matrix_and_coefficients();
                (2, Some(other), Some(other_coefficients))
            }
        };
        let kernel = &layout.kernels.normalize[usize::from(relu)][add];
        kernel.launch(
            layout.elementwise_grid(),
            layout.block(),
            0,
            &Normalize {
                x: kernel.ptr(&xm, layout.kind)?,
                coefficients: kernel.ptr(&coefficients, Kind::Float)?,
                other: kernel.ptr_or_null(other.as_ref(), layout.kind)?,
                other_coefficients: kernel.ptr_or_null(other_coefficients.as_ref(), Kind::Float)?,
                y: kernel.ptr(ym, layout.kind)?,
                rows: layout.rows,
                channels: layout.channels as i32,
            },
        )
    }
}

/// The pending outputs' producers by tag (tags from 1).
fn pending() -> MutexGuard<'static, Producers<Pointwise>> {
    static PENDING: Mutex<Producers<Pointwise>> = Mutex::new(Producers::starting_at(1));
    PENDING.lock().unwrap_or_else(PoisonError::into_inner)
}
