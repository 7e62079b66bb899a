//! CUDA graphs with kernel nodes, and stream capture into them.
//!
//! A graph is a list of kernel and host-function nodes in insertion order (dependencies always
//! point backwards, so that order is topological); launching an executable graph enqueues its
//! nodes on the stream, where the engine runs the kernels for their durations.

use parking_lot::Mutex;
use std::sync::Arc;

use crate::capture_mode;
use crate::ffi::*;
use crate::module::check_launch;
use crate::queue::{Capture, Node, Nodes, Op, StreamKind, host_op};
use crate::runtime::{Registry, guard, next_handle, put, rt};
use crate::stream::resolve;

/// A graph under construction.
pub struct Graph {
    pub id: usize,
    nodes: Nodes,
}

/// An instantiated graph.
pub struct GraphExec {
    pub id: usize,
    nodes: Vec<Node>,
}

impl Graph {
    fn push(&self, n: Node) {
        self.nodes.lock().push(n);
    }
}

pub static GRAPHS: Registry<Graph> = Registry::new();
pub static EXECS: Registry<GraphExec> = Registry::new();

fn new_graph() -> Arc<Graph> {
    let g = Arc::new(Graph {
        id: next_handle(),
        nodes: Arc::new(Mutex::new(Vec::new())),
    });
    GRAPHS.insert(g.id, g.clone());
    g
}

/// `cuGraphCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphCreate(pg: *mut Handle, flags: u32) -> CUresult {
    guard(|| {
        rt()?;
        if pg.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let g = new_graph();
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(pg, g.id as Handle) }
    })
}

/// `cuGraphDestroy`.
#[unsafe(no_mangle)]
pub extern "C" fn cuGraphDestroy(g: Handle) -> CUresult {
    guard(|| {
        rt()?;
        GRAPHS
            .remove(g as usize)
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    })
}

/// `cuGraphAddKernelNode_v2` (and v1, whose params struct is a prefix of v2's).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphAddKernelNode_v2(
    node: *mut Handle,
    g: Handle,
    deps: *const Handle,
    ndeps: usize,
    params: *const CUDA_KERNEL_NODE_PARAMS,
) -> CUresult {
    guard(|| {
        rt()?;
        if node.is_null() || params.is_null() || (ndeps > 0 && deps.is_null()) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let g = GRAPHS.get(g as usize).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: non-null params struct from the caller.
        let p = unsafe { &*params };
        // SAFETY: kernel params follow the cuLaunchKernel conventions.
        let ns = unsafe {
            check_launch(
                p.func,
                p.shape.grid,
                p.shape.block,
                p.kernel_params,
                p.extra,
            )
        }?;
        g.push(Node::Kernel(ns));
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(node, next_handle() as Handle) }
    })
}

/// `cuGraphInstantiateWithFlags`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    pe: *mut Handle,
    g: Handle,
    _flags: u64,
) -> CUresult {
    guard(|| {
        rt()?;
        if pe.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let g = GRAPHS.get(g as usize).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let e = Arc::new(GraphExec {
            id: next_handle(),
            nodes: g.nodes.lock().clone(),
        });
        EXECS.insert(e.id, e.clone());
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(pe, e.id as Handle) }
    })
}

/// `cuGraphExecDestroy`.
#[unsafe(no_mangle)]
pub extern "C" fn cuGraphExecDestroy(e: Handle) -> CUresult {
    guard(|| {
        rt()?;
        EXECS
            .remove(e as usize)
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    })
}

fn graph_launch(e: Handle, h: Handle, ptds: bool) -> CUresult {
    guard(|| {
        rt()?;
        let e = EXECS.get(e as usize).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let s = resolve(h, ptds)?;
        for n in &e.nodes {
            s.enqueue(match *n {
                Node::Kernel(ns) => Op::Kernel(ns),
                Node::Host(f, data) => host_op(f, data),
            });
        }
        Ok(())
    })
}

/// `cuGraphLaunch`.
#[unsafe(no_mangle)]
pub extern "C" fn cuGraphLaunch(e: Handle, h: Handle) -> CUresult {
    graph_launch(e, h, false)
}

/// `cuGraphLaunch_ptsz`.
#[unsafe(no_mangle)]
pub extern "C" fn cuGraphLaunch_ptsz(e: Handle, h: Handle) -> CUresult {
    graph_launch(e, h, true)
}

fn begin_capture(h: Handle, mode: u32, ptds: bool) -> CUresult {
    guard(|| {
        let s = resolve(h, ptds)?;
        if s.kind == StreamKind::Legacy {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        if s.capture().is_some() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if mode > 2 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let g = new_graph();
        let c = Arc::new(Capture::new(g.id, g.nodes.clone()));
        capture_mode::begun(&c, mode);
        s.set_capture(Some(c));
        Ok(())
    })
}

/// `cuStreamBeginCapture_v2`.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamBeginCapture_v2(h: Handle, mode: u32) -> CUresult {
    begin_capture(h, mode, false)
}

/// `cuStreamBeginCapture_v2_ptsz`.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamBeginCapture_v2_ptsz(h: Handle, mode: u32) -> CUresult {
    begin_capture(h, mode, true)
}

fn end_capture(h: Handle, pg: *mut Handle, ptds: bool) -> CUresult {
    guard(|| {
        if pg.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let s = resolve(h, ptds)?;
        let c = s.capture().ok_or(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED)?;
        s.set_capture(None);
        capture_mode::ended(&c);
        // An invalidated capture ends all the same, with no graph.
        if let Err(e) = c.check() {
            // SAFETY: non-null out-pointer from the caller.
            unsafe { put(pg, 0 as Handle) }?;
            return Err(e);
        }
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(pg, c.graph as Handle) }
    })
}

/// `cuStreamEndCapture`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture(h: Handle, pg: *mut Handle) -> CUresult {
    end_capture(h, pg, false)
}

/// `cuStreamEndCapture_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture_ptsz(h: Handle, pg: *mut Handle) -> CUresult {
    end_capture(h, pg, true)
}

fn is_capturing(h: Handle, out: *mut u32, ptds: bool) -> CUresult {
    guard(|| {
        let s = resolve(h, ptds)?;
        // SAFETY: caller's out-pointer, null-checked by put.
        unsafe { put(out, u32::from(s.capture().is_some())) }
    })
}

/// `cuStreamIsCapturing`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamIsCapturing(h: Handle, out: *mut u32) -> CUresult {
    is_capturing(h, out, false)
}

/// `cuStreamIsCapturing_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamIsCapturing_ptsz(h: Handle, out: *mut u32) -> CUresult {
    is_capturing(h, out, true)
}
