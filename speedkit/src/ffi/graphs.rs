//! CUDA graphs in the caching allocator's graph pools (`shim/graphs.cpp`).

use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{check, raw::graphs as abi, Result};

/// Identifies a memory pool of the caching allocator shared by several graphs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GraphPool(u64, u64);

impl GraphPool {
    pub(crate) fn new() -> Result<Self> {
        let (mut a, mut b) = (0, 0);
        // SAFETY: out-pointers valid for the call.
        check(unsafe { abi::sk_cuda_graph_pool_handle(&mut a, &mut b) })?;
        Ok(Self(a, b))
    }
}

/// An `at::cuda::CUDAGraph`.
pub(crate) struct CudaGraph(*mut c_void);

/// How many [`CudaGraph`]s exist in the process.
static LIVE_GRAPHS: AtomicUsize = AtomicUsize::new(0);

impl CudaGraph {
    pub(crate) fn new() -> Result<Self> {
        let mut raw = ptr::null_mut();
        // SAFETY: `raw` receives a heap object we own and free in Drop.
        check(unsafe { abi::sk_cuda_graph_new(&mut raw) })?;
        LIVE_GRAPHS.fetch_add(1, Ordering::SeqCst);
        Ok(Self(raw))
    }

    /// How many graphs exist in the process (captured or not).
    pub(crate) fn live() -> usize {
        LIVE_GRAPHS.load(Ordering::SeqCst)
    }

    pub(crate) fn capture_begin(&mut self, pool: GraphPool) -> Result<()> {
        // SAFETY: live graph.
        check(unsafe { abi::sk_cuda_graph_capture_begin(self.0, pool.0, pool.1) })
    }

    pub(crate) fn capture_end(&mut self) -> Result<()> {
        // SAFETY: live graph.
        check(unsafe { abi::sk_cuda_graph_capture_end(self.0) })
    }

    pub(crate) fn replay(&self) -> Result<()> {
        // SAFETY: live graph.
        check(unsafe { abi::sk_cuda_graph_replay(self.0) })
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: created by sk_cuda_graph_new, freed exactly once.
        unsafe { abi::sk_cuda_graph_free(self.0) }
        if LIVE_GRAPHS.fetch_sub(1, Ordering::SeqCst) == 1 {
            // The last graph: the cuBLAS workspaces its capture made in its pool go with it
            // (graph.rs frees the others before each capture). Best effort: a failure only keeps
            // the workspace until the next capture.
            let _ = super::device::release_blas_workspaces(0, true);
        }
    }
}
