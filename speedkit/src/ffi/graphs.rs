//! CUDA graphs in the caching allocator's graph pools (`shim/graphs.cpp`).

use std::ffi::c_void;
use std::ptr;

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

impl CudaGraph {
    pub(crate) fn new() -> Result<Self> {
        let mut raw = ptr::null_mut();
        // SAFETY: `raw` receives a heap object we own and free in Drop.
        check(unsafe { abi::sk_cuda_graph_new(&mut raw) })?;
        Ok(Self(raw))
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
    }
}
