//! A scenario as named steps: each step is logged as it begins, with the time since the
//! scenario began and what the step before took, and a failure names the step it came in.
//!
//! ```ignore
//! let mut s = Steps::new("a_killed_peer_falls_back_to_ud");
//! s.step("a bulk stream promoted to CM");
//! ...
//! s.step("B killed: A falls back to UD");
//! ...
//! ```

use std::time::{Duration, Instant};

/// The steps of one scenario, the one it is in last.
pub struct Steps {
    test: String,
    start: Instant,
    /// The step in progress: its number (from 1), name and start.
    current: Option<(usize, String, Instant)>,
}

impl Steps {
    pub fn new(test: &str) -> Self {
        Self {
            test: test.to_string(),
            start: Instant::now(),
            current: None,
        }
    }

    /// Ends the step in progress and begins `name`.
    pub fn step(&mut self, name: &str) {
        let now = Instant::now();
        let n = self.current.as_ref().map_or(1, |(n, ..)| n + 1);
        let before = self.current.as_ref().map_or_else(String::new, |(_, _, t)| {
            format!("; the step before took {:.1?}", now - *t)
        });
        eprintln!(
            "==> {} step {n} at {:.1?}: {name}{before}",
            self.test,
            now - self.start
        );
        self.current = Some((n, name.to_string(), now));
    }

    /// Where a failure now would be said to be: the step's number and name, and how long it
    /// has run (None: before the first step).
    pub fn at(&self) -> Option<(usize, &str, Duration)> {
        self.current
            .as_ref()
            .map(|(n, name, t)| (*n, name.as_str(), t.elapsed()))
    }
}

impl Steps {
    /// What is said when the scenario ends, by a panic or not.
    fn ending(&self, panicking: bool) -> Option<String> {
        let total = self.start.elapsed();
        match (panicking, self.at()) {
            (true, Some((n, name, into))) => Some(format!(
                "!!! {} FAILED in step {n} ({name}), {into:.1?} into it, {total:.1?} into the \
                 scenario",
                self.test
            )),
            (true, None) => Some(format!("!!! {} FAILED before its first step", self.test)),
            (false, Some((n, ..))) => Some(format!(
                "==> {}: {n} steps passed in {total:.1?}",
                self.test
            )),
            (false, None) => None,
        }
    }
}

impl Drop for Steps {
    fn drop(&mut self) {
        if let Some(line) = self.ending(std::thread::panicking()) {
            eprintln!("{line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_count_from_one_and_a_failure_names_the_last() {
        let mut s = Steps::new("t");
        assert!(s.at().is_none());
        assert_eq!(s.ending(false), None);
        assert_eq!(
            s.ending(true).as_deref(),
            Some("!!! t FAILED before its first step")
        );
        s.step("first");
        s.step("second");
        let (n, name, into) = s.at().unwrap();
        assert_eq!((n, name), (2, "second"));
        assert!(into < Duration::from_secs(60));
        let failed = s.ending(true).unwrap();
        assert!(
            failed.starts_with("!!! t FAILED in step 2 (second), "),
            "{failed}"
        );
        let passed = s.ending(false).unwrap();
        assert!(passed.starts_with("==> t: 2 steps passed in "), "{passed}");
    }
}
