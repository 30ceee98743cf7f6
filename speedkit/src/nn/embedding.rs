//! The input layer of a language model, token embedding plus learned position embedding, on one
//! kernel each way where speedkit's kernels run, with an ATen fallback that gives the same result
//! anywhere else.

use tch::{Kind, Tensor};

use crate::error::{Result, SpeedkitError};
use crate::{ffi, kernels};

const OP: &str = "embedding";

/// `table[tokens]`, plus `positions[t]` at every position `t` when a position table is given: a
/// GPT's input layer, a drop-in for `Tensor::embedding(table, tokens, ..)` followed by adding the
/// first `seq` rows of `positions`.
///
/// - `tokens`: int64 token ids, any shape without positions; `[batch, seq]` with them.
/// - `table`: `[vocab, width]`. The result has the shape of `tokens` plus `[width]`, in the table's
///   type.
/// - `positions`: `[max_seq, width]` of the table's type, with `max_seq ≥ seq`.
///
/// On a CUDA device of SM ≥ 8.0 with speedkit's kernels on, the forward is one pass that reads each
/// row of the two tables and writes their sum. The backward is deterministic: the tokens are
/// sorted stably (cub's radix sort over the bits a token id can have), and one kernel sums each
/// token's gradient rows in position order. Another kernel sums the position gradient over the
/// batch in batch order. It replaces ATen's gather and broadcast add, its sort-and-segment
/// embedding backward and a column reduction. Anywhere else (the CPU, kernels off, fp64 tables) it
/// runs ATen's ops and [`crate::kernels::fallbacks`] says why, once.
///
/// A token outside the table is an error on the CPU. On the GPU it is a device-side assert, as with
/// ATen's embedding.
///
/// # Errors
/// [`SpeedkitError::Misuse`] when the shapes do not fit together (tokens not int64 or not
/// `[batch, seq]` with positions, a sequence longer than the position table, widths that differ).
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let table = Tensor::randn([100, 16], (Kind::Float, Device::Cpu));
/// let positions = Tensor::randn([8, 16], (Kind::Float, Device::Cpu));
/// let tokens = Tensor::from_slice(&[3i64, 1, 4, 1, 5, 9]).view([2, 3]);
/// let x = speedkit::nn::embedding(&tokens, &table, Some(&positions))?;
/// assert_eq!(x.size(), [2, 3, 16]);
/// let expected = Tensor::embedding(&table, &tokens, -1, false, false) + positions.narrow(0, 0, 3);
/// assert!(x.allclose(&expected, 0.0, 0.0, false));
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn embedding(tokens: &Tensor, table: &Tensor, positions: Option<&Tensor>) -> Result<Tensor> {
    check_shapes(tokens, table, positions)?;
    match unsupported(tokens, table, positions) {
        None => match ffi::embedding(tokens, table, positions) {
            Ok(out) => {
                kernels::note_run(OP);
                return Ok(out);
            }
            Err(e) => kernels::note_fallback(OP, &format!("the kernel failed ({e})")),
        },
        Some(reason) => kernels::note_fallback(OP, &reason),
    }
    aten(tokens, table, positions)
}

/// Why [`embedding`] would run ATen's ops for these inputs, or `None` when it runs speedkit's
/// kernels.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let table = Tensor::randn([100, 16], (Kind::Float, Device::Cpu));
/// let tokens = Tensor::from_slice(&[3i64, 1, 4]);
/// assert!(speedkit::nn::embedding_fallback_reason(&tokens, &table, None).is_some());
/// ```
pub fn embedding_fallback_reason(
    tokens: &Tensor,
    table: &Tensor,
    positions: Option<&Tensor>,
) -> Option<String> {
    unsupported(tokens, table, positions)
}

fn aten(tokens: &Tensor, table: &Tensor, positions: Option<&Tensor>) -> Result<Tensor> {
    let out = Tensor::f_embedding(table, tokens, -1, false, false)?;
    match positions {
        Some(positions) => Ok(out.f_add(&positions.f_narrow(0, 0, tokens.size()[1])?)?),
        None => Ok(out),
    }
}

/// The misuse errors, the same on every path.
fn check_shapes(tokens: &Tensor, table: &Tensor, positions: Option<&Tensor>) -> Result<()> {
    let misuse = |what: String| Err(SpeedkitError::Misuse(format!("embedding: {what}")));
    if tokens.kind() != Kind::Int64 {
        return misuse(format!("the tokens must be int64, got {:?}", tokens.kind()));
    }
    let table_size = table.size();
    if table_size.len() != 2 {
        return misuse(format!(
            "the table must be [vocab, width], got {table_size:?}"
        ));
    }
    let Some(positions) = positions else {
        return Ok(());
    };
    let (token_size, position_size) = (tokens.size(), positions.size());
    if token_size.len() != 2 {
        return misuse(format!(
            "with positions the tokens must be [batch, seq], got {token_size:?}"
        ));
    }
    if position_size.len() != 2
        || position_size[1] != table_size[1]
        || position_size[0] < token_size[1]
    {
        return misuse(format!(
            "the positions must be [>= {}, {}] for tokens {token_size:?} and a table \
             {table_size:?}, got {position_size:?}",
            token_size[1], table_size[1]
        ));
    }
    if positions.kind() != table.kind() {
        return misuse(format!(
            "the positions ({:?}) must be of the table's type ({:?})",
            positions.kind(),
            table.kind()
        ));
    }
    Ok(())
}

fn unsupported(tokens: &Tensor, table: &Tensor, positions: Option<&Tensor>) -> Option<String> {
    if let Some(reason) = kernels::unusable_on(table.device()) {
        return Some(reason);
    }
    if !matches!(table.kind(), Kind::Float | Kind::BFloat16 | Kind::Half) {
        return Some(format!(
            "a table of type {:?} (the kernel takes fp32, bf16, fp16)",
            table.kind()
        ));
    }
    let on_table = |t: &Tensor| t.device() == table.device();
    if !on_table(tokens) || !positions.is_none_or(on_table) {
        return Some(format!(
            "tokens or positions on another device than the table ({:?})",
            table.device()
        ));
    }
    let limit = i64::from(i32::MAX);
    let (rows, size) = (tokens.numel() as i64, table.size());
    if rows > limit || size[0] > limit || size[1] > limit {
        return Some(format!("{rows} tokens over a table of {size:?}"));
    }
    None
}
