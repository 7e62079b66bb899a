//! Writes the seed corpus (`fuzz/corpus/<target>/seed-NN`) from `checks::seeds`.
//! Run from `fuzz/`: `cargo afl build --release && target/release/gen_corpus`. Not a fuzz target.

fn main() {
    for name in tessera_fuzz::checks::TARGETS {
        let dir = std::path::Path::new("corpus").join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for (i, seed) in tessera_fuzz::checks::seeds(name).iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i:02}")), seed).unwrap();
        }
    }
}
