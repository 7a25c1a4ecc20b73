//! Sets `cfg(avx512_intrinsics)` when the compiler has the AVX-512 intrinsics (stable since
//! Rust 1.89): `nn`'s convolution kernels then use them where the CPU has AVX-512, and AVX2
//! otherwise, so that the crate still builds with older compilers.

use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(avx512_intrinsics)");
    println!("cargo::rerun-if-env-changed=RUSTC");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_string());
    let minor = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|version| {
            // "rustc 1.95.0 (59807616e 2026-04-14)"
            let number = version.split_whitespace().nth(1)?.to_string();
            let mut parts = number.split('.');
            let major: u32 = parts.next()?.parse().ok()?;
            let minor: u32 = parts.next()?.parse().ok()?;
            (major == 1).then_some(minor)
        });
    if minor.is_some_and(|m| m >= 89) {
        println!("cargo::rustc-cfg=avx512_intrinsics");
    }
}
