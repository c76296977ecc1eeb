//! A service manager's notify socket, as systemd makes one for a `Type=notify` unit: a
//! datagram socket at a path (`NOTIFY_SOCKET`), each message a few `KEY=VALUE` lines. The
//! tests hand its path to `ipoib-ctl attach` and read what the daemon tells systemd.

use std::{
    os::unix::net::UnixDatagram,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

/// The socket, read by a thread of its own from the start (a sender blocks on a full socket,
/// so nothing may wait on the test to read), every message kept with when it came.
pub struct NotifySocket {
    path: PathBuf,
    heard: Arc<Mutex<Vec<Message>>>,
}

/// One message and when it arrived.
#[derive(Debug, Clone)]
pub struct Message {
    pub at: Instant,
    pub text: String,
}

impl Message {
    /// The message carries this `KEY=VALUE` line.
    pub fn has(&self, line: &str) -> bool {
        self.text.lines().any(|l| l == line)
    }

    /// The value of `KEY=` in the message.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.text
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
    }
}

impl NotifySocket {
    pub fn bind(tag: &str) -> std::io::Result<Self> {
        let path = std::env::temp_dir().join(format!("ipoib-notify-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let sock = UnixDatagram::bind(&path)?;
        let heard = Arc::new(Mutex::new(Vec::new()));
        let keep = Arc::downgrade(&heard);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            let _ = sock.set_read_timeout(Some(Duration::from_millis(200)));
            loop {
                let got = sock.recv(&mut buf);
                let Some(heard) = keep.upgrade() else { return };
                if let Ok(n) = got {
                    heard.lock().unwrap().push(Message {
                        at: Instant::now(),
                        text: String::from_utf8_lossy(&buf[..n]).into_owned(),
                    });
                }
            }
        });
        Ok(Self { path, heard })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every message so far.
    pub fn messages(&self) -> Vec<Message> {
        self.heard.lock().unwrap().clone()
    }

    /// The messages that came after `t`.
    pub fn since(&self, t: Instant) -> Vec<Message> {
        self.messages().into_iter().filter(|m| m.at > t).collect()
    }

    /// The first message after `t` that carries `line`, waiting up to `timeout` for it.
    pub fn wait_for(&self, line: &str, t: Instant, timeout: Duration) -> Option<Message> {
        let end = Instant::now() + timeout;
        loop {
            if let Some(m) = self.since(t).into_iter().find(|m| m.has(line)) {
                return Some(m);
            }
            if Instant::now() > end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The longest wait between two messages that carry `line` within `from`..`to`, the ends
    /// counted (none in between: the whole span).
    pub fn longest_gap(&self, line: &str, from: Instant, to: Instant) -> Duration {
        self.longest_gap_from(line, from, to).0
    }

    /// As [`NotifySocket::longest_gap`], with when the gap began (`from` or a message).
    pub fn longest_gap_from(&self, line: &str, from: Instant, to: Instant) -> (Duration, Instant) {
        let msgs = self.messages();
        let ends = msgs
            .iter()
            .filter(|m| m.at > from && m.at <= to && m.has(line))
            .map(|m| m.at)
            .chain([to]);
        let (mut last, mut gap) = (from, (Duration::ZERO, from));
        for at in ends {
            let wait = at.saturating_duration_since(last);
            if wait > gap.0 {
                gap = (wait, last);
            }
            last = at;
        }
        gap
    }
}

impl Drop for NotifySocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
