//! What the benchmarks share: the machine's busy CPU time and the median of rounds.

use std::path::Path;

use anyhow::{Context as _, Result, ensure};

/// /proc/stat's unit (USER_HZ): ticks per second.
pub const TICKS_PER_S: f64 = 100.0;

/// Busy ticks of all CPUs together (everything but idle and iowait), from /proc/stat.
pub fn busy_ticks() -> Result<u64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let v: Vec<u64> = stat
        .lines()
        .next()
        .context("/proc/stat")?
        .split_whitespace()
        .skip(1)
        .filter_map(|w| w.parse().ok())
        .collect();
    ensure!(v.len() >= 5, "/proc/stat: {v:?}");
    let idle = v[3] + v[4];
    Ok(v.iter().sum::<u64>() - idle)
}

/// The median of `v` (the upper one of an even count); NaN for none.
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The mean of the middle half of `v` (sorted): robust to the outliers a median is, and finer
/// than the clock's step when every sample is a multiple of it (a single BPF_PROG_TEST_RUN
/// is timed to 10 ns steps here).
pub fn interquartile_mean(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let mid = &v[v.len() / 4..v.len() - v.len() / 4];
    if mid.is_empty() {
        return f64::NAN;
    }
    mid.iter().sum::<f64>() / mid.len() as f64
}

/// Prints `result` as the one line after `BENCH-JSON ` and saves it to `out` when given.
pub fn publish(result: &serde_json::Value, out: Option<&Path>) -> Result<()> {
    println!("BENCH-JSON {result}");
    if let Some(out) = out {
        if let Some(dir) = out.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(out, format!("{result}\n"))
            .with_context(|| format!("saving {}", out.display()))?;
        println!("==> saved {}", out.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_none() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 3.0);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn interquartile_mean_drops_the_outer_quarters() {
        // 8 samples: the middle four are 20, 20, 30, 30; 1 and 1000 are outliers.
        let v = [30.0, 1.0, 20.0, 1000.0, 20.0, 30.0, 10.0, 40.0];
        assert_eq!(interquartile_mean(&v), 25.0);
        assert_eq!(interquartile_mean(&[7.0]), 7.0);
        assert!(interquartile_mean(&[]).is_nan());
    }

    #[test]
    fn busy_ticks_grow_with_work() {
        let a = busy_ticks().unwrap();
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(100) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        assert!(busy_ticks().unwrap() > a);
    }
}
