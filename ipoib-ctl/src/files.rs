//! Files other processes read while the control loop rewrites them (the state, the CM status,
//! the ledger's shares, the metrics textfile).

use std::{io, path::Path};

/// Replaces `path` whole: the bytes go to a hidden file beside it (`.NAME.tmp`, a name no
/// reader of the directory takes), which is renamed over it. A reader sees the old file or the
/// new one, never an empty or half-written one (`std::fs::write` truncates first: a reader in
/// between found nothing to parse).
pub fn replace(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "a path with no file name"))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(".tmp");
    let tmp = path.with_file_name(tmp_name);
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_replaced_whole_and_nothing_is_left_beside_it() {
        let dir = std::env::temp_dir().join(format!("ipoib-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ib0.cm.json");
        replace(&path, b"{\"first\": 1}").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"{\"first\": 1}");
        replace(&path, b"{}").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"{}");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["ib0.cm.json"]);
        assert!(replace(Path::new("/"), b"x").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
