//! Sums over columns: a reduction of every dimension but the last (a norm's weight gradient, a
//! bias's gradient over a batch of rows: ATen's `sum`, or `speedkit::column_sums`, which
//! speedkit's `linear` calls for its bias), or of every dimension but the one memory holds
//! innermost (a convolution's bias gradient over a channels-last image: its pixels are rows of
//! channels), computed by a row kernel as it writes its rows. A block with a row reduction of its
//! own (a norm's backward) sums the columns of its rows in shared memory; rows kept for their sums
//! alone are summed in strips, in registers (`loops::ColumnStrips`). The kernel's second entry
//! point (`GeneratedKernel::finish`) adds the blocks' sums up in block order, in slices where they
//! are many, so every run gives the same values.

use crate::trace::{TracedOp, TracedTensor, TracedValue};

use super::{
    check_contiguous, kind_of, rows_in_memory_order, sums_in_own_type, Generator, RowReduction,
};

/// The most blocks a kernel with column sums runs: each writes its sums of every column to the
/// workspace, which the second entry point then adds up.
pub(super) const COLUMN_BLOCKS: u64 = 1024;

/// The most floats a block's column sums take in shared memory (32 KiB).
const COLUMN_FLOATS: u64 = 8192;

/// Whether `op` sums every dimension but the last of a tensor of at least two dimensions, or every
/// dimension but the one memory holds innermost (a channels-last image's channels): in its own
/// type, the gradient of a weight or bias broadcast over rows as autograd sums it; or
/// `speedkit::column_sums` into a type the generator stores, a linear layer's bias gradient as
/// speedkit's `linear` sums it.
pub(crate) fn sums_columns(op: &TracedOp) -> bool {
    if op.schema.starts_with("speedkit::column_sums(") {
        return match (op.inputs.first(), op.outputs.as_slice()) {
            (Some(TracedValue::Tensor(input)), [TracedValue::Tensor(out)]) => {
                input.shape.len() >= 2 && kind_of(&out.dtype).is_some()
            }
            _ => false,
        };
    }
    let Some(TracedValue::Tensor(input)) = op.inputs.first() else {
        return false;
    };
    sums_in_own_type(op)
        .is_some_and(|(rank, dims)| rank >= 2 && column_dimension(input, &dims).is_some())
}

/// The dimension a sum over `dims` of `input` keeps, where it sums columns its memory holds as
/// rows: the last of a contiguous tensor, or the one memory holds innermost with the rest dense
/// around it. Any other sum stays ATen's, so that the chain making its input still fuses.
fn column_dimension(input: &TracedTensor, dims: &[i64]) -> Option<usize> {
    let rank = input.shape.len();
    let kept: Vec<usize> = (0..rank).filter(|&d| !dims.contains(&(d as i64))).collect();
    let [d] = kept[..] else {
        return None;
    };
    let last = d == rank - 1 && check_contiguous(input).is_ok();
    let innermost = input.strides[d] == 1 && rows_in_memory_order(input, input.shape[d] as u64);
    (dims.len() == rank - 1 && (last || innermost)).then_some(d)
}

impl Generator {
    /// A sum over columns ([`sums_columns`]) of a result of the group read at its own element: the
    /// group's rows are its input's, a block per row, with or without a reduction of their own
    /// (`columns` where they have none).
    pub(super) fn column_sum(&mut self, op: &TracedOp) -> Result<(), String> {
        let (Some(TracedValue::Tensor(input)), [TracedValue::Tensor(out)]) =
            (op.inputs.first(), op.outputs.as_slice())
        else {
            return Err(format!("{} without its input and result", op.name));
        };
        // `speedkit::column_sums` keeps the last dimension; ATen's sum the one it does not name.
        let column = super::reduced_dimensions(op)
            .and_then(|(_, dims)| column_dimension(input, &dims))
            .unwrap_or(input.shape.len() - 1);
        let width = input.shape[column].max(1) as u64;
        let rows = input.numel / width;
        let sums = self.reduction.as_ref().map_or(0, |r| r.column_sums.len()) as u64;
        let in_rows = check_contiguous(input).is_ok() || rows_in_memory_order(input, width);
        if out.numel != width || !in_rows || check_contiguous(out).is_err() {
            return Err("a sum over columns of other than its own rows".into());
        }
        if (sums + 1) * width > COLUMN_FLOATS {
            return Err(format!(
                "sums over {width} columns past the block's shared memory"
            ));
        }
        if !self.inside.contains(&(self.call, input.storage)) {
            return Err("a sum over columns of a tensor from outside the group".into());
        }
        match &self.reduction {
            None => {
                self.reduction = Some(RowReduction {
                    rows,
                    width,
                    op: "columns",
                    eps: 0.0,
                    gradients: None,
                    column_sums: Vec::new(),
                })
            }
            Some(r)
                if r.gradients.is_none()
                    && r.op != "moments"
                    && (r.rows, r.width) == (rows, width) => {}
            Some(_) => return Err("a sum over columns of other rows than the group's".into()),
        }
        let Some(value) = self.read_in_memory_order(input)? else {
            return Err("a sum over columns of other elements than its rows'".into());
        };
        let Some(r) = self.reduction.as_mut() else {
            return Err("a sum over columns without its rows".into());
        };
        r.column_sums.push(value);
        let which = r.column_sums.len() - 1;
        self.summed_result(op, out, which);
        Ok(())
    }
}
