//! The node's receive-memory budget, shared by every attached interface of the node (each its
//! own `attach` process): a directory of shares, one file per interface, read and written
//! under an exclusive `flock`, so each take sees what every other interface holds at that
//! moment and the sum never passes the budget.
//!
//! * A node is a network namespace (its interfaces; the lab's nodes share one machine): the
//!   directory is `/run/ipoib-ctl/node-budget/NETNS`, NETNS the namespace's inode.
//! * Each share records what its interface holds (an SRQ from its start, rings as they are
//!   registered), its process and the node budget it was started with; the node's budget is
//!   the smallest a live share names. A share whose process is gone (a crash) counts for
//!   nothing and is removed by the next take.
//! * The arithmetic ([`fits`], [`node_budget`]) is pure; [`Ledger`] does the file I/O.

use std::{
    fs::File,
    io,
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
    sync::Mutex,
};

use serde::{Deserialize, Serialize};

use crate::verbs::SharedBudget;

/// Where the ledgers live, one directory per network namespace.
pub const LEDGER_DIR: &str = "/run/ipoib-ctl/node-budget";

/// What one interface holds of the node's budget.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Share {
    pub iface: String,
    pub pid: u32,
    /// Receive memory it holds registered now (or is about to register).
    pub bytes: u64,
    /// The node budget its process was started with.
    pub node_budget: u64,
}

/// The node's budget: the smallest that `mine` or a live share names.
pub fn node_budget(mine: u64, others: &[Share]) -> u64 {
    others.iter().map(|s| s.node_budget).fold(mine, u64::min)
}

/// Whether `more` bytes fit beside `mine` and what the `others` hold, within `budget`.
pub fn fits(budget: u64, others: &[Share], mine: u64, more: u64) -> bool {
    let held = others.iter().fold(0u64, |a, s| a.saturating_add(s.bytes));
    held.saturating_add(mine).saturating_add(more) <= budget
}

/// This network namespace's ledger directory.
fn this_node() -> io::Result<PathBuf> {
    let ns = std::fs::read_link("/proc/self/ns/net")?;
    let id: String = ns
        .to_string_lossy()
        .chars()
        .filter(char::is_ascii_digit)
        .collect();
    Ok(Path::new(LEDGER_DIR).join(id))
}

/// The node's budget as one more attach would find it now ([`node_budget_now`]).
pub struct NodeNow {
    pub budget: u64,
    /// Where the budget came from.
    pub source: String,
    /// What the running attaches leave free of it.
    pub free: u64,
    /// What each of them holds.
    pub shares: Vec<Share>,
}

/// The node's budget as one more attach would find it now, for a machine of `mem` bytes: the
/// automatic rule's, or a running attach's smaller `--node-memory-budget`.
pub fn node_budget_now(mem: u64) -> NodeNow {
    let (node, source) = crate::plan::budget(mem, None);
    let shares = shares_now().unwrap_or_default();
    let held: u64 = shares.iter().map(|s| s.bytes).sum();
    let (budget, source) = match shares.iter().map(|s| s.node_budget).min() {
        Some(set) if set < node => (set, "a running attach's --node-memory-budget".to_string()),
        _ => (node, source),
    };
    NodeNow {
        budget,
        source,
        free: budget.saturating_sub(held),
        shares,
    }
}

/// The live shares of this node's ledger, read without joining it (for `caps`); none when no
/// interface holds a share.
pub fn shares_now() -> io::Result<Vec<Share>> {
    let dir = this_node()?;
    if !dir.exists() {
        return Ok(Vec::new());
    }
    read_shares(&dir, None, false)
}

/// The ledger's lock, held until the returned file is dropped.
fn lock(dir: &Path) -> io::Result<File> {
    let f = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(".lock"))?;
    // SAFETY: flock on an fd this function owns; released when the file is closed.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(f)
}

/// The live shares in `dir` but `except`. With `prune` (under the lock only) those of dead
/// processes are removed; without, a reader takes no lock: a share is replaced whole, by a
/// rename, and a view must not wait on another interface's loop (stopped, say, holding it).
fn read_shares(dir: &Path, except: Option<&Path>, prune: bool) -> io::Result<Vec<Share>> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let path = e?.path();
        if path.extension().is_none_or(|x| x != "json") || Some(path.as_path()) == except {
            continue;
        }
        let share = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<Share>(&b).ok());
        match share {
            Some(s) if Path::new(&format!("/proc/{}", s.pid)).exists() => v.push(s),
            _ if prune => {
                let _ = std::fs::remove_file(&path);
            }
            _ => {}
        }
    }
    Ok(v)
}

/// This interface's share of the node's budget, kept in the ledger; removed when dropped.
#[derive(Debug)]
pub struct Ledger {
    dir: PathBuf,
    iface: String,
    budget: u64,
    /// What this interface holds (the file says the same, written under the lock).
    held: Mutex<u64>,
}

impl Ledger {
    /// Joins the ledger of this process's network namespace, holding nothing yet, with the
    /// node budget `budget` (its start's: the automatic rule or `--node-memory-budget`).
    pub fn join(iface: &str, budget: u64) -> io::Result<Self> {
        Self::join_at(&this_node()?, iface, budget)
    }

    /// [`Ledger::join`] with the ledger in `dir` (tests).
    pub fn join_at(dir: &Path, iface: &str, budget: u64) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let l = Self {
            dir: dir.to_path_buf(),
            iface: iface.to_string(),
            budget,
            held: Mutex::new(0),
        };
        let _lock = l.lock()?;
        l.write(0)?;
        Ok(l)
    }

    /// The node's budget and every share in it (this one included), dead ones left out; read
    /// without the lock (the status, every tick).
    pub fn view(&self) -> io::Result<(u64, Vec<Share>)> {
        let others = read_shares(&self.dir, Some(&self.path()), false)?;
        let budget = node_budget(self.budget, &others);
        let mut all = others;
        all.push(self.share(*self.held.lock().unwrap()));
        all.sort_by(|a, b| a.iface.cmp(&b.iface));
        Ok((budget, all))
    }

    /// Takes `bytes` when they fit beside what every interface holds; false when they do not.
    pub fn try_take(&self, bytes: u64) -> io::Result<bool> {
        let _lock = self.lock()?;
        let others = self.others()?;
        let mut held = self.held.lock().unwrap();
        if !fits(node_budget(self.budget, &others), &others, *held, bytes) {
            return Ok(false);
        }
        self.write(*held + bytes)?;
        *held += bytes;
        Ok(true)
    }

    /// Gives `bytes` back.
    pub fn give_back(&self, bytes: u64) -> io::Result<()> {
        let _lock = self.lock()?;
        let mut held = self.held.lock().unwrap();
        *held = held.saturating_sub(bytes);
        self.write(*held)
    }

    /// What this interface holds now.
    pub fn held(&self) -> u64 {
        *self.held.lock().unwrap()
    }

    fn share(&self, bytes: u64) -> Share {
        Share {
            iface: self.iface.clone(),
            pid: std::process::id(),
            bytes,
            node_budget: self.budget,
        }
    }

    fn path(&self) -> PathBuf {
        self.dir.join(format!("{}.json", self.iface))
    }

    /// Writes this share (under the lock): a new file renamed over the old one.
    fn write(&self, bytes: u64) -> io::Result<()> {
        crate::files::replace(&self.path(), &serde_json::to_vec(&self.share(bytes))?)
    }

    /// The other interfaces' live shares, the dead ones' removed (under the lock).
    fn others(&self) -> io::Result<Vec<Share>> {
        read_shares(&self.dir, Some(&self.path()), true)
    }

    fn lock(&self) -> io::Result<File> {
        lock(&self.dir)
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        if let Ok(_lock) = self.lock() {
            let _ = std::fs::remove_file(self.path());
        }
    }
}

/// The rings of an interface take from the node's budget: a ledger that cannot be read or
/// written refuses (the budget is a limit).
impl SharedBudget for Ledger {
    fn take(&self, bytes: u64) -> bool {
        self.try_take(bytes).unwrap_or_else(|e| {
            tracing::warn!("the node budget's ledger in {}: {e}", self.dir.display());
            false
        })
    }

    fn give_back(&self, bytes: u64) {
        if let Err(e) = Ledger::give_back(self, bytes) {
            tracing::warn!("the node budget's ledger in {}: {e}", self.dir.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn share(iface: &str, bytes: u64, node_budget: u64) -> Share {
        Share {
            iface: iface.into(),
            pid: 1,
            bytes,
            node_budget,
        }
    }

    #[test]
    fn the_sum_of_every_share_stays_within_the_budget() {
        let others = [
            share("ib0", 40 * MIB, 64 * MIB),
            share("ib1", 8 * MIB, 64 * MIB),
        ];
        assert!(fits(64 * MIB, &others, 12 * MIB, 4 * MIB), "64 exactly");
        assert!(!fits(64 * MIB, &others, 12 * MIB, 4 * MIB + 1));
        assert!(fits(64 * MIB, &[], 0, 64 * MIB));
        assert!(!fits(64 * MIB, &[], 60 * MIB, 8 * MIB));
        assert!(!fits(u64::MAX - 1, &others, u64::MAX, 1), "no overflow");
    }

    #[test]
    fn the_node_budget_is_the_smallest_a_live_share_names() {
        assert_eq!(node_budget(64 * MIB, &[]), 64 * MIB);
        let others = [share("ib0", 0, 32 * MIB), share("ib1", 0, 128 * MIB)];
        assert_eq!(node_budget(64 * MIB, &others), 32 * MIB);
        assert_eq!(node_budget(16 * MIB, &others), 16 * MIB);
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ipoib-ledger-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn two_interfaces_share_one_budget_through_the_files() {
        let d = dir("two");
        let ib0 = Ledger::join_at(&d, "ib0", 12 * MIB).unwrap();
        let ib1 = Ledger::join_at(&d, "ib1", 12 * MIB).unwrap();
        assert!(ib0.try_take(4 * MIB).unwrap());
        assert!(ib0.try_take(4 * MIB).unwrap());
        assert!(ib1.try_take(4 * MIB).unwrap());
        assert!(!ib1.try_take(4 * MIB).unwrap(), "12 MiB are held");
        assert!(!ib0.try_take(1).unwrap());
        let (budget, shares) = ib1.view().unwrap();
        assert_eq!(budget, 12 * MIB);
        let held: Vec<(&str, u64)> = shares.iter().map(|s| (s.iface.as_str(), s.bytes)).collect();
        assert_eq!(held, [("ib0", 8 * MIB), ("ib1", 4 * MIB)]);
        ib0.give_back(4 * MIB).unwrap();
        assert!(ib1.try_take(4 * MIB).unwrap(), "what ib0 gave back");
        // ib0 gone: all it held is free.
        drop(ib0);
        assert!(ib1.try_take(4 * MIB).unwrap());
        assert_eq!(ib1.held(), 12 * MIB);
        assert_eq!(ib1.view().unwrap().1.len(), 1);
        drop(ib1);
        assert_eq!(
            std::fs::read_dir(&d).unwrap().count(),
            1,
            "only the lock is left"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn as_the_engines_budget_a_ledger_takes_gives_back_and_refuses_when_it_cannot_be_read() {
        let d = dir("trait");
        let ib0 = Ledger::join_at(&d, "ib0", 8 * MIB).unwrap();
        let budget: &dyn SharedBudget = &ib0;
        assert!(budget.take(6 * MIB));
        assert!(!budget.take(4 * MIB), "8 MiB is the budget");
        budget.give_back(6 * MIB);
        assert_eq!(ib0.held(), 0);
        assert!(budget.take(8 * MIB), "what was given back");
        budget.give_back(8 * MIB);
        // The ledger's directory gone: it cannot be read, and the budget is a limit.
        std::fs::remove_dir_all(&d).unwrap();
        assert!(!budget.take(MIB));
        assert_eq!(ib0.held(), 0);
    }

    #[test]
    fn a_view_does_not_wait_for_the_lock() {
        let d = dir("view");
        let ib0 = Ledger::join_at(&d, "ib0", 8 * MIB).unwrap();
        assert!(ib0.try_take(2 * MIB).unwrap());
        // Another interface's loop holds the lock (stopped, say, in the middle of a take).
        let held = lock(&d).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let dd = d.clone();
        std::thread::spawn(move || {
            let ib1 = Ledger {
                dir: dd,
                iface: "ib1".into(),
                budget: 8 * MIB,
                held: Mutex::new(0),
            };
            let _ = tx.send(ib1.view().map(|(_, shares)| shares.len()));
        });
        let seen = rx.recv_timeout(std::time::Duration::from_secs(10));
        drop(held);
        assert_eq!(seen.expect("the view waited for the lock").unwrap(), 2);
        drop(ib0);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_dead_process_holds_nothing() {
        let d = dir("dead");
        let ib1 = Ledger::join_at(&d, "ib1", 8 * MIB).unwrap();
        // A share left by a process that died (pid_max is at most 2^22).
        let dead = Share {
            pid: 1 << 23,
            ..share("ib0", 8 * MIB, 8 * MIB)
        };
        std::fs::write(d.join("ib0.json"), serde_json::to_vec(&dead).unwrap()).unwrap();
        assert_eq!(ib1.view().unwrap().1.len(), 1, "the dead share is not seen");
        assert!(d.join("ib0.json").exists(), "a view removes nothing");
        assert!(ib1.try_take(8 * MIB).unwrap());
        assert!(!d.join("ib0.json").exists(), "removed by the take");
        drop(ib1);
        let _ = std::fs::remove_dir_all(&d);
    }
}
