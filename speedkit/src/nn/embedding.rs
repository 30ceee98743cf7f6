//! The input layer of a language model, token embedding plus learned position embedding, on one
//! kernel each way where speedkit's kernels run, with an ATen fallback that gives the same result
//! anywhere else.

use tch::{Kind, Tensor};

use crate::error::{Result, SpeedkitError};
use crate::ffi;

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
/// runs ATen's ops, and [`crate::kernels::notes`] say why.
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
    ffi::embedding::embedding(tokens, table, positions)
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
    ffi::embedding::unsupported(tokens, table, positions).unwrap_or_else(|e| Some(e.to_string()))
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
