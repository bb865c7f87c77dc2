//! Error codes on the wire. The numbers are Linux errno values, so the mount's
//! error → errno table is the identity and a code read in a packet capture is familiar.
//! A code is never renumbered; unknown codes from a newer peer decode as `Io`.

use serde::{Deserialize, Serialize};

/// Encoded on the wire as its errno number (a u16), not as an enum index, so that codes can
/// be added in any order and a code unknown to an older peer decodes as `Io`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ErrorCode {
    NotPermitted = 1,
    NotFound = 2,
    Io = 5,
    BadHandle = 9,
    WouldBlock = 11,
    PermissionDenied = 13,
    Busy = 16,
    Exists = 17,
    CrossDevice = 18,
    NotDirectory = 20,
    IsDirectory = 21,
    InvalidArgument = 22,
    FileTooBig = 27,
    NoSpace = 28,
    ReadOnly = 30,
    TooManyLinks = 31,
    OutOfRange = 34,
    NameTooLong = 36,
    NotImplemented = 38,
    NotEmpty = 39,
    Loop = 40,
    NoData = 61,
    Protocol = 71,
    Overflow = 75,
    /// A metadata server that does not lead its replicated cluster (EREMCHG): the client
    /// goes to the leader the message names, or tries the others. Never reaches users.
    NotLeader = 78,
    NotSupported = 95,
    Unreachable = 107,
    TimedOut = 110,
    Stale = 116,
}

impl ErrorCode {
    /// The errno a POSIX caller gets for this code.
    pub fn errno(self) -> i32 {
        self as u16 as i32
    }

    /// A short human name, used in error messages.
    pub fn describe(self) -> &'static str {
        match self {
            ErrorCode::NotPermitted => "operation not permitted",
            ErrorCode::NotFound => "no such file or directory",
            ErrorCode::Io => "input/output error",
            ErrorCode::BadHandle => "bad file handle",
            ErrorCode::WouldBlock => "resource temporarily unavailable",
            ErrorCode::PermissionDenied => "permission denied",
            ErrorCode::Busy => "device or resource busy",
            ErrorCode::Exists => "file exists",
            ErrorCode::CrossDevice => "cross-device link",
            ErrorCode::NotDirectory => "not a directory",
            ErrorCode::IsDirectory => "is a directory",
            ErrorCode::InvalidArgument => "invalid argument",
            ErrorCode::FileTooBig => "file too large",
            ErrorCode::NoSpace => "no space left on device",
            ErrorCode::ReadOnly => "read-only file system",
            ErrorCode::TooManyLinks => "too many links",
            ErrorCode::OutOfRange => "result out of range",
            ErrorCode::NameTooLong => "file name too long",
            ErrorCode::NotImplemented => "function not implemented",
            ErrorCode::NotEmpty => "directory not empty",
            ErrorCode::Loop => "too many levels of symbolic links",
            ErrorCode::NoData => "no data available",
            ErrorCode::Protocol => "protocol error",
            ErrorCode::Overflow => "value too large",
            ErrorCode::NotLeader => "not the metadata leader",
            ErrorCode::NotSupported => "operation not supported",
            ErrorCode::Unreachable => "not connected to the server",
            ErrorCode::TimedOut => "timed out",
            ErrorCode::Stale => "stale file handle",
        }
    }

    /// The code for an errno, `Io` for any errno without a code of its own.
    pub fn from_errno(errno: i32) -> ErrorCode {
        match errno {
            1 => ErrorCode::NotPermitted,
            2 => ErrorCode::NotFound,
            9 => ErrorCode::BadHandle,
            11 => ErrorCode::WouldBlock,
            13 => ErrorCode::PermissionDenied,
            16 => ErrorCode::Busy,
            17 => ErrorCode::Exists,
            18 => ErrorCode::CrossDevice,
            20 => ErrorCode::NotDirectory,
            21 => ErrorCode::IsDirectory,
            22 => ErrorCode::InvalidArgument,
            27 => ErrorCode::FileTooBig,
            28 | 122 => ErrorCode::NoSpace,
            30 => ErrorCode::ReadOnly,
            31 => ErrorCode::TooManyLinks,
            34 => ErrorCode::OutOfRange,
            36 => ErrorCode::NameTooLong,
            38 => ErrorCode::NotImplemented,
            39 => ErrorCode::NotEmpty,
            40 => ErrorCode::Loop,
            61 => ErrorCode::NoData,
            71 => ErrorCode::Protocol,
            75 => ErrorCode::Overflow,
            78 => ErrorCode::NotLeader,
            95 => ErrorCode::NotSupported,
            107 => ErrorCode::Unreachable,
            110 => ErrorCode::TimedOut,
            116 => ErrorCode::Stale,
            _ => ErrorCode::Io,
        }
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u16(*self as u16)
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<ErrorCode, D::Error> {
        let number = u16::deserialize(deserializer)?;
        Ok(ErrorCode::from_errno(i32::from(number)))
    }
}

/// An error as sent in a reply: a code and a message naming what failed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{} ({}): {message}", code.describe(), code.errno())]
pub struct WireError {
    pub code: ErrorCode,
    pub message: String,
}

impl WireError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> WireError {
        WireError {
            code,
            message: message.into(),
        }
    }
}

impl From<std::io::Error> for WireError {
    fn from(error: std::io::Error) -> WireError {
        let code = error
            .raw_os_error()
            .map(ErrorCode::from_errno)
            .unwrap_or(ErrorCode::Io);
        WireError::new(code, error.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_travel_as_errno_numbers_and_unknown_ones_become_io() {
        for code in [
            ErrorCode::NotPermitted,
            ErrorCode::PermissionDenied,
            ErrorCode::NotEmpty,
            ErrorCode::NotLeader,
            ErrorCode::Stale,
        ] {
            let bytes = crate::encode(&code);
            assert_eq!(crate::decode::<u16>(&bytes).unwrap(), code as u16);
            assert_eq!(crate::decode::<ErrorCode>(&bytes).unwrap(), code);
            assert_eq!(ErrorCode::from_errno(code.errno()), code);
        }
        let unknown = crate::encode(&4000u16);
        assert_eq!(crate::decode::<ErrorCode>(&unknown).unwrap(), ErrorCode::Io);
    }
}
