//! User and group names to ids, through the C library (so NSS sources, LDAP included, name
//! them as `id` and `ls -l` do). Looked up once, when the flags are read.

use std::ffi::CString;

/// A name the system does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum NameError {
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

/// Looks `name` up with a reentrant `get*nam_r` (`call(entry, buffer, out)`), retrying with a
/// larger buffer on `ERANGE`; `id` reads the id from the entry found. `None`: no such entry.
///
/// # Safety
/// `T` is a plain C struct (`group`, `passwd`) for which all zero bytes is a valid value, and
/// `call` passes its three arguments to a `get*nam_r` of that struct with the buffer's length.
unsafe fn lookup<T>(
    call: impl Fn(&mut T, &mut [u8], &mut *mut T) -> libc::c_int,
    id: impl Fn(&T) -> u32,
) -> Option<u32> {
    let mut size = BUF;
    loop {
        let mut buf = vec![0u8; size];
        // SAFETY: the caller promises all zero bytes is a valid `T`, to be filled in.
        let mut entry: T = unsafe { std::mem::zeroed() };
        let mut out: *mut T = std::ptr::null_mut();
        let rc = call(&mut entry, &mut buf, &mut out);
        if rc == libc::ERANGE && size < MAX_BUF {
            size *= 4;
            continue;
        }
        return (rc == 0 && !out.is_null()).then(|| id(&entry));
    }
}

/// `--users-group`: a gid, or a group name looked up now.
pub(crate) fn parse_group(text: &str) -> Result<u32, NameError> {
    let t = text.trim();
    if let Ok(gid) = t.parse::<u32>() {
        return Ok(gid);
    }
    let name = CString::new(t).map_err(|_| NameError::Group(t.into()))?;
    // SAFETY: every pointer is valid for the call: `name` is NUL-terminated, `grp` and `out`
    // are ours, `buf` is its length; the strings written stay in `buf`, unused after.
    let call = |grp: &mut libc::group, buf: &mut [u8], out: &mut *mut libc::group| unsafe {
        libc::getgrnam_r(name.as_ptr(), grp, buf.as_mut_ptr().cast(), buf.len(), out)
    };
    // SAFETY: `group` is a plain C struct; `call` is getgrnam_r with `buf`'s length.
    let gid = unsafe { lookup(call, |grp| grp.gr_gid) };
    gid.ok_or_else(|| NameError::Group(t.into()))
}

/// A uid, or a user name looked up now.
pub(crate) fn uid_of(text: &str) -> Result<u32, NameError> {
    let t = text.trim();
    if let Ok(uid) = t.parse::<u32>() {
        return Ok(uid);
    }
    let name = CString::new(t).map_err(|_| NameError::User(t.into()))?;
    // SAFETY: as in `parse_group`, with a `passwd`.
    let call = |pw: &mut libc::passwd, buf: &mut [u8], out: &mut *mut libc::passwd| unsafe {
        libc::getpwnam_r(name.as_ptr(), pw, buf.as_mut_ptr().cast(), buf.len(), out)
    };
    // SAFETY: `passwd` is a plain C struct; `call` is getpwnam_r with `buf`'s length.
    let uid = unsafe { lookup(call, |pw| pw.pw_uid) };
    uid.ok_or_else(|| NameError::User(t.into()))
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
