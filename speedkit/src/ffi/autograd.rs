//! The backward graph behind a tensor (`shim/autograd.cpp`).

use std::ffi::CStr;
use std::ptr;

use tch::Tensor;

use super::{check, handle, handles, owned_or_none, raw::autograd as abi, Result};

/// The backward graph of a tensor: every node's name (each node once), and the identities of the
/// leaf variables that receive gradients.
pub(crate) fn graph(root: &Tensor) -> Result<(Vec<String>, Vec<u64>)> {
    let mut raw = ptr::null_mut();
    // SAFETY: live handle for the call; `raw` receives a heap object freed below.
    check(unsafe { abi::sk_autograd_graph(handle(root), &mut raw) })?;
    let read = || -> Result<(Vec<String>, Vec<u64>)> {
        let (mut nodes, mut leaves) = (0i64, 0i64);
        // SAFETY: live graph, valid out-pointers.
        check(unsafe { abi::sk_autograd_graph_sizes(raw, &mut nodes, &mut leaves) })?;
        let mut names = Vec::with_capacity(nodes as usize);
        for i in 0..nodes {
            let mut name = ptr::null();
            // SAFETY: live graph, index in range, `name` receives a pointer owned by the graph.
            check(unsafe { abi::sk_autograd_graph_node(raw, i, &mut name) })?;
            // SAFETY: NUL-terminated, alive until the graph is freed below.
            names.push(
                unsafe { CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned(),
            );
        }
        let mut ids = Vec::with_capacity(leaves as usize);
        for i in 0..leaves {
            let mut id = 0u64;
            // SAFETY: live graph, index in range, valid out-pointer.
            check(unsafe { abi::sk_autograd_graph_leaf(raw, i, &mut id) })?;
            ids.push(id);
        }
        Ok((names, ids))
    };
    let out = read();
    // SAFETY: created by sk_autograd_graph, freed exactly once.
    unsafe { abi::sk_autograd_graph_free(raw) };
    out
}

/// The identity autograd keys a variable by (comparable with [`graph`]'s leaves).
pub(crate) fn tensor_identity(tensor: &Tensor) -> Result<u64> {
    let mut id = 0u64;
    // SAFETY: live handle, valid out-pointer.
    check(unsafe { abi::sk_tensor_identity(handle(tensor), &mut id) })?;
    Ok(id)
}

/// Back-propagates from `outputs` with `grad_outputs` as their gradients.
/// Whether grad mode is on for the calling thread.
pub(crate) fn grad_mode_enabled() -> Result<bool> {
    let mut enabled = 0;
    // SAFETY: a valid out-pointer.
    check(unsafe { abi::sk_grad_mode_enabled(&mut enabled) })?;
    Ok(enabled != 0)
}

/// The identity of the node that made `tensor` (0 for none): unique while that node lives.
pub(crate) fn grad_fn_identity(tensor: &Tensor) -> Result<u64> {
    let mut id = 0;
    // SAFETY: a live handle, a valid out-pointer.
    check(unsafe { abi::sk_tensor_grad_fn_identity(handle(tensor), &mut id) })?;
    Ok(id)
}

pub(crate) fn backward(outputs: &[Tensor], grad_outputs: &[Tensor]) -> Result<()> {
    let (o, g) = (handles(outputs), handles(grad_outputs));
    // SAFETY: live handles of equal length for the call (the caller checked the lengths).
    check(unsafe { abi::sk_autograd_backward(o.as_ptr(), g.as_ptr(), o.len() as i64) })
}

/// The gradients of `inputs` from `outputs` with `grad_outputs`, accumulated into nothing.
pub(crate) fn grad(
    outputs: &[Tensor],
    grad_outputs: &[Tensor],
    inputs: &[Tensor],
) -> Result<Vec<Option<Tensor>>> {
    let (o, g, i) = (handles(outputs), handles(grad_outputs), handles(inputs));
    let mut out = vec![ptr::null_mut(); i.len()];
    // SAFETY: live handles for the call (`o` and `g` of equal length, checked by the caller); `out`
    // has room for one handle per input, filled with fresh tensors or null.
    check(unsafe {
        abi::sk_autograd_grad(
            o.as_ptr(),
            g.as_ptr(),
            o.len() as i64,
            i.as_ptr(),
            i.len() as i64,
            out.as_mut_ptr(),
        )
    })?;
    // SAFETY: fresh tensors from the shim, or null.
    Ok(out
        .into_iter()
        .map(|t| unsafe { owned_or_none(t) })
        .collect())
}
