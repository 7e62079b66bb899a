//! User and group names to ids, through the C library (so NSS sources, LDAP included, name
//! them as `id` and `ls -l` do). Looked up once, when the flags are read.

use std::ffi::CString;

/// A name the system does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// No such user.
    #[error("no user {0:?} on this system (give a name or a numeric uid)")]
    User(String),
    /// No such group.
    #[error(
        "no group {0:?} on this system (give a name or a numeric gid; create it with groupadd)"
    )]
    Group(String),
}

/// Buffer for the `*_r` lookups' strings; entries longer than this (huge member lists) are
/// retried with a larger one.
const BUF: usize = 16 * 1024;
const MAX_BUF: usize = 1 << 20;

/// `--users-group`: a gid, or a group name looked up now.
pub fn parse_group(text: &str) -> Result<u32, NameError> {
    let t = text.trim();
    if let Ok(gid) = t.parse::<u32>() {
        return Ok(gid);
    }
    let name = CString::new(t).map_err(|_| NameError::Group(t.into()))?;
    let mut size = BUF;
    loop {
        let mut buf = vec![0u8; size];
        // SAFETY: a zeroed `group` is a valid value to be filled in.
        let mut grp: libc::group = unsafe { std::mem::zeroed() };
        let mut out: *mut libc::group = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call: `name` is NUL-terminated, `grp` and `out`
        // are ours, `buf` is `size` bytes; the strings written stay in `buf`, unused after.
        let rc = unsafe {
            libc::getgrnam_r(
                name.as_ptr(),
                &mut grp,
                buf.as_mut_ptr().cast(),
                size,
                &mut out,
            )
        };
        if rc == libc::ERANGE && size < MAX_BUF {
            size *= 4;
            continue;
        }
        return if rc == 0 && !out.is_null() {
            Ok(grp.gr_gid)
        } else {
            Err(NameError::Group(t.into()))
        };
    }
}

/// A uid, or a user name looked up now.
pub fn uid_of(text: &str) -> Result<u32, NameError> {
    let t = text.trim();
    if let Ok(uid) = t.parse::<u32>() {
        return Ok(uid);
    }
    let name = CString::new(t).map_err(|_| NameError::User(t.into()))?;
    let mut size = BUF;
    loop {
        let mut buf = vec![0u8; size];
        // SAFETY: a zeroed `passwd` is a valid value to be filled in.
        let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
        let mut out: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: as in `parse_group`, with a `passwd`.
        let rc = unsafe {
            libc::getpwnam_r(
                name.as_ptr(),
                &mut pw,
                buf.as_mut_ptr().cast(),
                size,
                &mut out,
            )
        };
        if rc == libc::ERANGE && size < MAX_BUF {
            size *= 4;
            continue;
        }
        return if rc == 0 && !out.is_null() {
            Ok(pw.pw_uid)
        } else {
            Err(NameError::User(t.into()))
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_numbers() {
        // root is user and group 0 on every Linux system.
        assert_eq!(uid_of("root"), Ok(0));
        assert_eq!(parse_group("root"), Ok(0));
        assert_eq!(uid_of(" 61001 "), Ok(61001));
        assert_eq!(parse_group("61000"), Ok(61000));
        assert!(matches!(
            uid_of("no-such-user-here"),
            Err(NameError::User(_))
        ));
        assert!(matches!(
            parse_group("no-such-group-here"),
            Err(NameError::Group(_))
        ));
    }
}
