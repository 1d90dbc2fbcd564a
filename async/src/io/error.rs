//! What I/O futures resolve to: the buffer back, or the error with the buffer.

use hypoll_reactor::{IoBuf, IoFailure, RejectReason};

/// Why an async I/O did not succeed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IoError {
    /// The reactor refused it for a reason waiting does not cure (an unknown device, a
    /// request past the namespace, a reactor shutting down...): it never reached the
    /// device. (A full queue pair is not a refusal here: the future waits for room.)
    #[error("refused: {0}")]
    Refused(RejectReason),
    /// It reached the device, or waited for a slot, and failed.
    #[error("{0}")]
    Failed(IoFailure),
}

/// Shorthand for a [`IoFailure`] as the futures report it.
impl From<IoFailure> for IoError {
    fn from(failure: IoFailure) -> Self {
        IoError::Failed(failure)
    }
}

/// A failed read or write, with its buffer back when there is one to give back (not for
/// [`IoFailure::Abandoned`]: the device may still use it, so the reactor keeps it).
///
/// Boxed, so that a read's output (`Result<IoBuf, BufError>`) is no wider than the buffer
/// itself: every I/O moves it from the completion to the task, and only a failure pays
/// for the box (one small allocation).
pub struct BufError(Box<Parts>);

struct Parts {
    error: IoError,
    buf: Option<IoBuf>,
}

impl BufError {
    pub fn new(error: IoError, buf: Option<IoBuf>) -> BufError {
        BufError(Box::new(Parts { error, buf }))
    }

    pub fn error(&self) -> IoError {
        self.0.error
    }

    /// The buffer given back, if there is one.
    pub fn buf(&self) -> Option<&IoBuf> {
        self.0.buf.as_ref()
    }

    pub fn into_buf(self) -> Option<IoBuf> {
        self.0.buf
    }

    pub fn into_parts(self) -> (IoError, Option<IoBuf>) {
        let parts = *self.0;
        (parts.error, parts.buf)
    }
}

impl std::fmt::Debug for BufError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufError")
            .field("error", &self.0.error)
            .field("buf", &self.0.buf.as_ref().map(|b| b.len()))
            .finish()
    }
}

impl std::fmt::Display for BufError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.error.fmt(f)
    }
}

impl std::error::Error for BufError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0.error)
    }
}

/// What an [`IoFuture`](crate::IoFuture) resolves to, made from the I/O's result and its
/// buffer.
pub trait IoOutput: Sized {
    fn from_parts(result: Result<(), IoError>, buf: Option<IoBuf>) -> Self;

    /// From a completion: `from_parts` without the refusal (the usual path, made without
    /// the wider error in between).
    #[inline]
    fn from_done(result: Result<(), IoFailure>, buf: Option<IoBuf>) -> Self {
        Self::from_parts(result.map_err(IoError::Failed), buf)
    }

    /// From a completion that succeeded: `from_done` with its result known (the usual
    /// path, made without a result to look at).
    #[inline]
    fn from_ok(buf: Option<IoBuf>) -> Self {
        Self::from_done(Ok(()), buf)
    }

    /// The other way: the result and the buffer apart, for code that handles every
    /// outcome alike (answers an error, then puts the buffer back in its pool).
    fn into_parts(self) -> (Result<(), IoError>, Option<IoBuf>);
}

/// A read or write: the buffer back, or the error with it.
impl IoOutput for Result<IoBuf, BufError> {
    #[inline]
    fn from_parts(result: Result<(), IoError>, buf: Option<IoBuf>) -> Self {
        match (result, buf) {
            (Ok(()), Some(buf)) => Ok(buf),
            (Ok(()), None) => unreachable!("a read or write that succeeds returns its buffer"),
            (Err(error), buf) => Err(BufError::new(error, buf)),
        }
    }

    fn into_parts(self) -> (Result<(), IoError>, Option<IoBuf>) {
        match self {
            Ok(buf) => (Ok(()), Some(buf)),
            Err(error) => split(error),
        }
    }

    #[inline(always)]
    fn from_done(result: Result<(), IoFailure>, buf: Option<IoBuf>) -> Self {
        if result.is_ok() {
            return Self::from_ok(buf);
        }
        failed(result, buf)
    }

    #[inline(always)]
    fn from_ok(buf: Option<IoBuf>) -> Self {
        match buf {
            Some(buf) => Ok(buf),
            None => failed(Ok(()), None),
        }
    }
}

/// The output of a read or write that did not succeed.
#[cold]
#[inline(never)]
fn failed(result: Result<(), IoFailure>, buf: Option<IoBuf>) -> Result<IoBuf, BufError> {
    Result::<IoBuf, BufError>::from_parts(result.map_err(IoError::Failed), buf)
}

/// Flush, write zeroes, deallocate: no buffer.
impl IoOutput for Result<(), IoError> {
    #[inline]
    fn from_parts(result: Result<(), IoError>, _buf: Option<IoBuf>) -> Self {
        result
    }

    fn into_parts(self) -> (Result<(), IoError>, Option<IoBuf>) {
        (self, None)
    }
}

/// Any I/O ([`Local::submit`](crate::Local::submit)): the buffer, if it had one.
impl IoOutput for Result<Option<IoBuf>, BufError> {
    #[inline]
    fn from_parts(result: Result<(), IoError>, buf: Option<IoBuf>) -> Self {
        match result {
            Ok(()) => Ok(buf),
            Err(error) => Err(BufError::new(error, buf)),
        }
    }

    fn into_parts(self) -> (Result<(), IoError>, Option<IoBuf>) {
        match self {
            Ok(buf) => (Ok(()), buf),
            Err(error) => split(error),
        }
    }
}

/// A failed I/O's error and buffer, apart.
fn split(error: BufError) -> (Result<(), IoError>, Option<IoBuf>) {
    let (error, buf) = error.into_parts();
    (Err(error), buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `into_parts` undoes `from_parts` for every output: the result and the buffer come
    /// apart as they went in, a failure's buffer included.
    #[test]
    fn into_parts_gives_back_what_from_parts_was_given() {
        let failed = Err(IoError::Failed(IoFailure::Shutdown));
        let buf = || Some(IoBuf::from_slice(&[3; 512]));

        let (result, back) = Result::<IoBuf, BufError>::from_parts(Ok(()), buf()).into_parts();
        assert_eq!((result, back.map(|b| b[0])), (Ok(()), Some(3)));
        let (result, back) = Result::<IoBuf, BufError>::from_parts(failed, buf()).into_parts();
        assert_eq!((result, back.map(|b| b.len())), (failed, Some(512)));

        let any = Result::<Option<IoBuf>, BufError>::from_parts(failed, buf());
        let (result, back) = any.into_parts();
        assert_eq!((result, back.is_some()), (failed, true));
        let none = Result::<Option<IoBuf>, BufError>::from_parts(Ok(()), None);
        assert_eq!(none.into_parts().0, Ok(()));

        let (result, back) = Result::<(), IoError>::from_parts(failed, None).into_parts();
        assert_eq!((result, back.is_none()), (failed, true));
    }
}
