//! [`Maintenance`] of an NFS store. Through a kernel mount the export is a
//! directory with the Posix store's layout (`<root>/<2 hex>/<32 hex>`), so
//! the Posix maintenance serves it as is; its clean-up removes only
//! temporaries idle for an hour, which no live writer leaves that long (it
//! abandons a block after twice the task timeout). The built-in client's
//! URLs are refused with what to do instead.

use super::config::{NfsConfig, Target};
use crate::error::{Result, UcmError};
use crate::store::posix::PosixMaintenance;

/// The maintenance of the NFS store `cfg` names (only `storage_backends`
/// is used).
pub fn maintenance(cfg: &NfsConfig) -> Result<PosixMaintenance> {
    match cfg.parse_target()?.0 {
        Target::Mounted(dir) => PosixMaintenance::new(vec![dir]),
        Target::Remote { host, path } => Err(UcmError::invalid(format!(
            "storage_backends: nfs://{host}{path} is reached by the built-in NFS client, \
             which store maintenance does not use; mount the export and name its \
             directory (a kernel-mounted NFS store), or give --dir DIR"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::maintain::Maintenance;

    #[test]
    fn a_mounted_export_is_a_directory_and_a_url_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let mounted = NfsConfig {
            target: d.path().display().to_string(),
            ..Default::default()
        };
        let m = maintenance(&mounted).unwrap();
        assert_eq!(m.location(), d.path().display().to_string());
        assert!(m.blocks().unwrap().is_empty());
        let url = NfsConfig {
            target: "nfs://server/export/kv".into(),
            ..Default::default()
        };
        let e = maintenance(&url)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("mount the export"), "{e}");
    }
}
