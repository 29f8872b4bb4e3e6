//! The data cipher's own rate on one core: AES-XTS-256 over 4 KiB (8 sectors, a buffer
//! encrypted in place) and over 128 KiB, encrypt and decrypt, for `--seconds` each (default
//! 1), printed as JSON lines in GB/s. `scripts/bench-crypt.py` runs it beside
//! `openssl speed -evp aes-256-xts` so the gap to the machine's best is a number.
//!
//!     cargo run --release -p spool-crypt --example xts_rate -- --seconds 2

use std::time::{Duration, Instant};

use spool_crypt::XtsCipher;

fn rate(bytes: usize, secs: f64, f: &mut dyn FnMut(&mut [u8], u64)) -> f64 {
    let mut buf = vec![0x5au8; bytes];
    let sectors = (bytes / 512) as u64;
    for i in 0..64 {
        f(&mut buf, i * sectors);
    }
    let (t0, mut n) = (Instant::now(), 0u64);
    while t0.elapsed() < Duration::from_secs_f64(secs) {
        for _ in 0..64 {
            f(&mut buf, n * sectors);
            n += 1;
        }
    }
    std::hint::black_box(&buf);
    (n as f64 * bytes as f64) / t0.elapsed().as_secs_f64() / 1e9
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let secs = match args.iter().position(|a| a == "--seconds") {
        Some(i) => args.get(i + 1).and_then(|s| s.parse().ok()).unwrap_or(1.0),
        None => 1.0,
    };
    let key: [u8; 64] = std::array::from_fn(|i| (i as u8).wrapping_mul(37).wrapping_add(1));
    let c = XtsCipher::new(&key).expect("halves differ");
    for bytes in [4096usize, 128 << 10] {
        let enc = rate(bytes, secs, &mut |b, s| c.encrypt(b, s));
        let dec = rate(bytes, secs, &mut |b, s| c.decrypt(b, s));
        println!("{{\"bytes\": {bytes}, \"encrypt_gbps\": {enc:.3}, \"decrypt_gbps\": {dec:.3}}}");
    }
}
