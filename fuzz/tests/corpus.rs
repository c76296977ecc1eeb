//! Every fuzz target's property on its seed corpus and on every input that once failed it:
//! on stable, in the test suite, so a regression fails here and not only under the fuzzer.

use ipoib_fuzz::{TARGETS, corpus_dir, regressions_dir};

fn inputs(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<_> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| (p.display().to_string(), std::fs::read(&p).unwrap()))
        .collect();
    found.sort();
    found
}

#[test]
fn every_target_holds_on_its_seeds_and_past_findings() {
    for (target, property) in TARGETS {
        let seeds = inputs(&corpus_dir(target));
        assert!(
            seeds.len() >= 3,
            "{target}: {} seeds in {}",
            seeds.len(),
            corpus_dir(target).display()
        );
        for (name, data) in seeds.iter().chain(&inputs(&regressions_dir(target))) {
            eprintln!("{target}: {name}");
            property(data);
        }
    }
}

/// The CM status seeds are files as the product writes them: each decodes, else the property
/// stops at the decoder's refusal and tests nothing past it.
#[test]
fn the_cm_status_seeds_decode() {
    for (name, data) in inputs(&corpus_dir("cm_status")) {
        if let Err(e) = serde_json::from_slice::<ipoib_ctl::status::cm::CmStatus>(&data) {
            panic!("{name}: {e}");
        }
    }
}
