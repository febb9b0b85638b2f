use std::time::SystemTime;

use super::*;
use crate::store::maintain::{execute, plan_clear, plan_gc, verify_all, ItemKind, Target};
use crate::store::{PosixConfig, PosixStore, Store};
use crate::{MemSeg, ShardIo};

fn config(dir: &std::path::Path) -> PosixConfig {
    PosixConfig {
        storage_backends: vec![dir.to_path_buf()],
        block_size: 8192,
        shard_size: 4096,
        tensor_size_list: vec![4096],
        ..Default::default()
    }
}

/// A store in `dir` holding blocks `[b; 16]` for each `b`, closed.
fn fill(dir: &std::path::Path, blocks: &[u8]) {
    let store = PosixStore::open(config(dir)).unwrap();
    let data = vec![7u8; 4096];
    for &b in blocks {
        let shards = (0..2)
            .map(|i| ShardIo {
                block: BlockId([b; 16]),
                index: i,
                segs: vec![MemSeg {
                    addr: data.as_ptr() as usize,
                    len: 4096,
                }],
            })
            .collect();
        let t = store.dump(shards, 0).unwrap();
        store.wait(t).unwrap();
    }
}

fn ids(m: &PosixMaintenance) -> Vec<BlockId> {
    let mut ids: Vec<_> = m
        .list(false)
        .unwrap()
        .blocks
        .into_iter()
        .map(|e| e.id)
        .collect();
    ids.sort();
    ids
}

/// Every file and link under `dir` with a hash of its bytes (a link: of
/// its target), but the usage record, which removals update.
fn snapshot(dir: &std::path::Path) -> Vec<(PathBuf, u64)> {
    use crate::hashing::xxh3::xxh3_64;
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let t = e.file_type().unwrap();
            if t.is_dir() {
                todo.push(e.path());
            } else if t.is_symlink() {
                let target = std::fs::read_link(e.path()).unwrap();
                out.push((e.path(), xxh3_64(target.as_os_str().as_encoded_bytes())));
            } else if t.is_file() && e.file_name() != USAGE_FILE {
                out.push((e.path(), xxh3_64(&std::fs::read(e.path()).unwrap())));
            } else if !t.is_file() {
                out.push((e.path(), 0));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn lists_verifies_and_removes() {
    let d = tempfile::tempdir().unwrap();
    fill(d.path(), &[1, 2, 3]);
    let m = PosixMaintenance::new(vec![d.path().to_path_buf()]).unwrap();
    assert_eq!(
        m.identity()[0].1,
        Identity::Marked {
            format: marker::FORMAT
        }
    );
    assert_eq!(
        ids(&m),
        vec![BlockId([1; 16]), BlockId([2; 16]), BlockId([3; 16])]
    );
    let detailed = m.list(true).unwrap();
    assert!(detailed
        .blocks
        .iter()
        .all(|b| b.bytes == Some(16384) && b.modified.is_some()));
    for id in ids(&m) {
        m.verify(&id).unwrap();
    }
    // Flip a data byte of block 2's second shard.
    let path = m.tree.block_path(&BlockId([2; 16]));
    let mut raw = std::fs::read(&path).unwrap();
    raw[2 * 4096 + 4096 + 10] ^= 1;
    std::fs::write(&path, raw).unwrap();
    let e = m.verify(&BlockId([2; 16])).unwrap_err();
    assert!(
        e.to_string().contains("shard 1: data checksum mismatch"),
        "{e}"
    );
    let report = verify_all(&m, &Progress::default()).unwrap();
    assert_eq!((report.blocks, report.failures.len()), (3, 1));
    assert_eq!(
        m.remove(&BlockId([2; 16])).unwrap(),
        Removal::Removed { bytes: 16384 }
    );
    assert_eq!(m.remove(&BlockId([2; 16])).unwrap(), Removal::Gone);
    assert_eq!(ids(&m).len(), 2);
    // The closed store's work directory goes; a block file stays.
    let plan = plan_gc(&m, &Progress::default()).unwrap();
    assert_eq!(plan.remove.len(), 1, "{plan:?}");
    assert_eq!(plan.remove[0].kind, ItemKind::StoppedStore);
    let out = execute(&m, &plan, &Progress::default()).unwrap();
    assert_eq!(out.removed.len(), 1);
    assert_eq!(
        std::fs::read_dir(d.path().join(".work")).unwrap().count(),
        0
    );
    assert_eq!(ids(&m).len(), 2);
}

/// A folder that is not a store is refused, naming it and why, with
/// nothing in it changed; a store written before markers is recognised
/// by its blocks and marked by the first removal.
#[test]
fn only_stores_are_accepted() {
    let d = tempfile::tempdir().unwrap();
    let open = |p: &std::path::Path| PosixMaintenance::new(vec![p.to_path_buf()]);
    let e = open(d.path()).err().unwrap().to_string();
    assert!(
        e.contains(&d.path().display().to_string()) && e.contains("no block file"),
        "{e}"
    );
    let id = BlockId([0xab; 16]);
    std::fs::create_dir(d.path().join("ab")).unwrap();
    std::fs::write(d.path().join("ab").join(id.hex()), b"a user's file").unwrap();
    let before = snapshot(d.path());
    let e = open(d.path()).err().unwrap().to_string();
    assert!(
        e.contains(&format!("ab/{}", id.hex())) && e.contains("bad magic"),
        "{e}"
    );
    assert_eq!(snapshot(d.path()), before);

    let s = tempfile::tempdir().unwrap();
    fill(s.path(), &[4, 5]);
    std::fs::remove_file(s.path().join(MARKER_FILE)).unwrap();
    let m = open(s.path()).unwrap();
    assert_eq!(m.identity()[0].1, Identity::Adoptable { sampled: 2 });
    assert!(!s.path().join(MARKER_FILE).exists(), "not marked by a look");
    let plan = plan_clear(&m, &Progress::default()).unwrap();
    let out = execute(&m, &plan, &Progress::default()).unwrap();
    assert_eq!(out.marked, vec![s.path().display().to_string()]);
    assert_eq!(marker::read(m.tree.root(0)).unwrap(), Some(marker::FORMAT));
    assert!(ids(&m).is_empty());

    std::fs::write(s.path().join(MARKER_FILE), "ucm store\nformat 99\n").unwrap();
    let e = open(s.path()).err().unwrap().to_string();
    assert!(e.contains("newer ucm"), "{e}");
}

/// Links at block directories' and blocks' names, FIFOs, users' files and
/// another block's copy at a block's name: none of it is followed or
/// removed; only the store's own blocks go.
#[test]
fn removes_only_what_ucm_wrote() {
    let d = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    fill(d.path(), &[1, 2, 3]);
    let block = |b: u8| {
        d.path()
            .join(format!("{b:02x}"))
            .join(BlockId([b; 16]).hex())
    };
    // Block directory 03 replaced by a link to a folder holding a real block.
    std::fs::rename(d.path().join("03"), outside.path().join("03")).unwrap();
    std::os::unix::fs::symlink(outside.path().join("03"), d.path().join("03")).unwrap();
    // A link to a real block file outside, at block 4's name.
    std::fs::copy(block(1), outside.path().join("copy")).unwrap();
    std::fs::create_dir_all(d.path().join("04")).unwrap();
    std::os::unix::fs::symlink(outside.path().join("copy"), block(4)).unwrap();
    // A user's file at block 5's name, block 1's copy at block 6's.
    std::fs::create_dir_all(d.path().join("05")).unwrap();
    std::fs::write(block(5), vec![0x55; 16384]).unwrap();
    std::fs::create_dir_all(d.path().join("06")).unwrap();
    std::fs::copy(block(1), block(6)).unwrap();
    // A FIFO at block 7's name, a user's notes beside the blocks.
    std::fs::create_dir_all(d.path().join("07")).unwrap();
    let c = std::ffi::CString::new(block(7).into_os_string().into_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    std::fs::write(d.path().join("01").join("notes.txt"), b"mine").unwrap();
    let outside_before = snapshot(outside.path());

    let m = PosixMaintenance::new(vec![d.path().to_path_buf()]).unwrap();
    let plan = plan_clear(&m, &Progress::default()).unwrap();
    let going: Vec<_> = plan
        .remove
        .iter()
        .map(|i| match &i.target {
            Target::Block(id) => *id,
            Target::Leftover(_) => panic!("{i:?}"),
        })
        .collect();
    assert_eq!(going, vec![BlockId([1; 16]), BlockId([2; 16])]);
    let kept: Vec<_> = plan
        .keep
        .iter()
        .map(|k| format!("{}: {}", k.label, k.reason))
        .collect();
    let text = kept.join("\n");
    for (what, why) in [
        ("03", "symbolic link, not a block directory"),
        (&BlockId([4; 16]).hex(), "symbolic link at a block's name"),
        (&BlockId([5; 16]).hex(), "bad magic"),
        (&BlockId([6; 16]).hex(), "another block"),
        (&BlockId([7; 16]).hex(), "FIFO"),
    ] {
        assert!(
            kept.iter().any(|k| k.contains(what) && k.contains(why)),
            "{what}: {text}"
        );
    }
    let mut before = snapshot(d.path());
    execute(&m, &plan, &Progress::default()).unwrap();
    before.retain(|(p, _)| *p != block(1) && *p != block(2));
    assert_eq!(snapshot(d.path()), before);
    assert_eq!(snapshot(outside.path()), outside_before);
    // A file swapped in after the plan is checked again at its removal.
    fill(d.path(), &[8]);
    let plan = plan_clear(&m, &Progress::default()).unwrap();
    std::fs::write(block(8), b"replaced by a user").unwrap();
    let out = execute(&m, &plan, &Progress::default()).unwrap();
    assert!(out.removed.is_empty() && out.kept.len() == 1, "{out:?}");
    assert_eq!(std::fs::read(block(8)).unwrap(), b"replaced by a user");
}

/// `gc` removes a dead store's work files and idle temporaries, by their
/// names only, and never a live store's.
#[test]
fn gc_removes_only_what_stopped_stores_wrote() {
    let d = tempfile::tempdir().unwrap();
    fill(d.path(), &[1]);
    let live = PosixStore::open(config(d.path())).unwrap();
    let work = d.path().join(".work");
    let dead: Vec<_> = std::fs::read_dir(&work)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            std::fs::read_dir(p)
                .unwrap()
                .flatten()
                .any(|f| f.file_name() == "closed")
        })
        .collect();
    assert_eq!(
        dead.len(),
        0,
        "the live store adopted the closed one's directory"
    );
    // A killed store's directory (unlocked, not closed) with a user's file.
    let killed = work.join("00112233aabbccdd");
    std::fs::create_dir(&killed).unwrap();
    std::fs::write(killed.join("lock"), b"").unwrap();
    std::fs::write(killed.join("spare.3"), vec![0u8; 16384]).unwrap();
    std::fs::write(
        killed.join(format!("{}.4", BlockId([9; 16]).hex())),
        b"part",
    )
    .unwrap();
    std::fs::write(killed.join("notes.txt"), b"mine").unwrap();
    std::fs::write(work.join("README"), b"mine").unwrap();
    // Temporaries: one idle for two hours, one fresh, one not ours.
    let dir = d.path().join("09");
    std::fs::create_dir_all(&dir).unwrap();
    let hex = BlockId([9; 16]).hex();
    let (old, fresh, other) = (
        dir.join(format!("{hex}.tmp.0badc0de.1")),
        dir.join(format!("{hex}.tmp.0badc0de.2")),
        dir.join(format!("{hex}.tmp.my copy")),
    );
    for p in [&old, &fresh, &other] {
        std::fs::write(p, b"x").unwrap();
    }
    let long_ago = SystemTime::now() - Duration::from_secs(7200);
    for p in [&old, &other] {
        File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_modified(long_ago)
            .unwrap();
    }
    let m = PosixMaintenance::new(vec![d.path().to_path_buf()]).unwrap();
    let plan = plan_gc(&m, &Progress::default()).unwrap();
    let mut labels: Vec<_> = plan
        .remove
        .iter()
        .map(|i| (i.kind, i.label.clone()))
        .collect();
    labels.sort();
    assert_eq!(
        labels,
        vec![
            (ItemKind::StoppedStore, killed.display().to_string()),
            (ItemKind::IdleTemp, old.display().to_string()),
        ]
    );
    let out = execute(&m, &plan, &Progress::default()).unwrap();
    assert_eq!(out.failed, vec![]);
    let mut left: Vec<_> = std::fs::read_dir(&killed)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    left.sort();
    assert_eq!(left, ["notes.txt"]);
    assert!(work.join("README").exists() && fresh.exists() && other.exists() && !old.exists());
    // The live store's directory and blocks are untouched.
    assert_eq!(ids(&m), vec![BlockId([1; 16])]);
    let token_dirs = std::fs::read_dir(&work)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir())
        .count();
    assert_eq!(
        token_dirs, 2,
        "the live store's and the killed one's (a user's file in it)"
    );
    drop(live);
}
