//! Per-core reactors: pinned threads that own queue pairs, pollers, messages, timers and
//! idle sleep. Not built yet (issue 3); the crate exists so the workspace has its final shape.
