//! Validation of user-chosen names (tenants, templates, workspaces, labels).
//!
//! Names become parts of object-store keys, catalog rows and socket paths, so the rule is strict:
//! 1–63 characters from `[A-Za-z0-9._-]`, starting with a letter or digit. That excludes `/`,
//! `..`, whitespace, control characters and anything that could escape a key prefix.

use crate::Error;

pub const MAX_NAME_LEN: usize = 63;

/// Checks a name; `what` names the kind of name in the error ("workspace name").
pub fn validate(what: &'static str, name: &str) -> Result<(), Error> {
    if name.is_empty() {
        return Err(Error::invalid(what, "must not be empty"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(Error::invalid(
            what,
            format!("{} characters is longer than {MAX_NAME_LEN}", name.len()),
        ));
    }
    check_chars(what, name)
}

/// A non-empty name starts with a letter or digit and holds only `[A-Za-z0-9._-]`.
fn check_chars(what: &'static str, name: &str) -> Result<(), Error> {
    if !name.as_bytes()[0].is_ascii_alphanumeric() {
        return Err(Error::invalid(what, "must start with a letter or digit"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(Error::invalid(
            what,
            format!("character {c:?} is not allowed (use letters, digits, '.', '_', '-')"),
        ));
    }
    Ok(())
}

/// Labels are free text shown to people, not keys: up to 200 printable characters.
/// Longest relay file name.
pub const MAX_FILE_NAME_LEN: usize = 200;

/// A file name inside a relay stream (WAL segments, `.history`, `.backup`, tarballs): 1–200 of
/// `[A-Za-z0-9._-]`, starting with a letter or digit. No separators, so never a path.
pub fn validate_file_name(name: &str) -> Result<(), Error> {
    const WHAT: &str = "file name";
    if name.is_empty() || name.len() > MAX_FILE_NAME_LEN {
        return Err(Error::invalid(WHAT, "must be 1 to 200 characters"));
    }
    check_chars(WHAT, name)
}

pub fn validate_label(label: &str) -> Result<(), Error> {
    if label.is_empty() || label.chars().count() > 200 {
        return Err(Error::invalid("label", "must be 1 to 200 characters"));
    }
    if label.chars().any(|c| c.is_control()) {
        return Err(Error::invalid(
            "label",
            "must not contain control characters",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relay_file_names() {
        for ok in [
            "000000010000000000000001",
            "00000002.history",
            "000000010000000000000002.00000028.backup",
            "base.tar.gz",
        ] {
            validate_file_name(ok).unwrap();
        }
        for bad in [
            "",
            ".",
            "..",
            "../etc/passwd",
            "a/b",
            ".hidden",
            "a b",
            "x\0",
            &"a".repeat(201),
        ] {
            assert!(validate_file_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn hostile_names_are_refused() {
        for bad in [
            "",
            "..",
            ".",
            "../x",
            "a/b",
            "a\0b",
            "a\nb",
            " a",
            "a b",
            "-x",
            ".hidden",
            "é",
            &"x".repeat(64),
        ] {
            assert!(validate("name", bad).is_err(), "{bad:?} accepted");
        }
        for good in ["a", "ws-1", "my_ws.2", "A9", &"x".repeat(63)] {
            validate("name", good).unwrap();
        }
    }

    #[test]
    fn labels() {
        validate_label("before upgrade: v2").unwrap();
        assert!(validate_label("a\u{7}").is_err());
        assert!(validate_label("").is_err());
    }
}
