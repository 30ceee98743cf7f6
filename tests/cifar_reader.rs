//! The CIFAR-10 binary reader on small generated files (the real files are 30 MB each and are
//! not downloaded by anything here).

use speedkit_suite::data::cifar::{normalize, Cifar10, Split, RECORD_BYTES};
use std::path::PathBuf;
use tch::Kind;

/// A record whose label is `label` and whose pixel at (channel c, row y, column x) is
/// `(seed + c·7 + y·3 + x) mod 256`, so every position is distinguishable.
fn record(label: u8, seed: u8) -> Vec<u8> {
    let mut r = vec![label];
    for c in 0..3u32 {
        for y in 0..32u32 {
            for x in 0..32u32 {
                r.push(((u32::from(seed) + c * 7 + y * 3 + x) % 256) as u8);
            }
        }
    }
    assert_eq!(r.len(), RECORD_BYTES);
    r
}

fn pixel(seed: u8, c: u32, y: u32, x: u32) -> i64 {
    i64::from(((u32::from(seed) + c * 7 + y * 3 + x) % 256) as u8)
}

/// A fresh directory under cargo's per-target temporary directory.
fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("cifar_reader_{name}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn parses_labels_and_channel_planes() {
    let bytes: Vec<u8> = [record(3, 0), record(9, 100), record(0, 200)].concat();
    let set = Cifar10::parse(&bytes).unwrap();
    assert_eq!(set.len(), 3);
    assert_eq!(set.images.size(), [3, 3, 32, 32]);
    assert_eq!(set.images.kind(), Kind::Uint8);
    assert_eq!(Vec::<i64>::try_from(&set.labels).unwrap(), [3, 9, 0]);
    for (i, seed) in [0u8, 100, 200].into_iter().enumerate() {
        for (c, y, x) in [(0, 0, 0), (0, 0, 31), (1, 5, 2), (2, 31, 31)] {
            let got = set
                .images
                .int64_value(&[i as i64, c as i64, y as i64, x as i64]);
            assert_eq!(
                got,
                pixel(seed, c, y, x),
                "image {i}, channel {c}, ({y}, {x})"
            );
        }
    }
}

#[test]
fn rejects_truncated_files_bad_labels_and_empty_input() {
    let mut bytes = record(1, 0);
    bytes.pop();
    let e = Cifar10::parse(&bytes).unwrap_err().to_string();
    assert!(e.contains("whole number"), "{e}");
    let e = Cifar10::parse(&[record(1, 0), record(10, 0)].concat())
        .unwrap_err()
        .to_string();
    assert!(e.contains("record 1") && e.contains("label 10"), "{e}");
    assert!(Cifar10::parse(&[]).is_err());
}

#[test]
fn loads_every_training_file_in_order_and_the_test_file() {
    let dir = scratch("load");
    std::fs::write(
        dir.join("data_batch_2.bin"),
        [record(2, 2), record(3, 3)].concat(),
    )
    .unwrap();
    std::fs::write(dir.join("data_batch_1.bin"), record(1, 1)).unwrap();
    std::fs::write(dir.join("test_batch.bin"), record(7, 7)).unwrap();
    std::fs::write(dir.join("batches.meta.txt"), "airplane\n").unwrap();

    let train = Cifar10::load(&dir, Split::Train).unwrap();
    assert_eq!(Vec::<i64>::try_from(&train.labels).unwrap(), [1, 2, 3]);
    assert_eq!(train.images.int64_value(&[2, 0, 0, 0]), pixel(3, 0, 0, 0));
    let test = Cifar10::load(&dir, Split::Test).unwrap();
    assert_eq!(Vec::<i64>::try_from(&test.labels).unwrap(), [7]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_directory_without_cifar_files_is_an_error_that_says_what_to_pass() {
    let dir = scratch("empty");
    let e = Cifar10::load(&dir, Split::Train).unwrap_err().to_string();
    assert!(
        e.contains("data_batch_") && e.contains("cifar-10-batches-bin"),
        "{e}"
    );
    let e = format!("{:#}", Cifar10::load(&dir, Split::Test).unwrap_err());
    assert!(e.contains("test_batch.bin"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn batches_are_normalised_floats_with_their_labels() {
    let set = Cifar10::parse(&[record(4, 0), record(5, 50)].concat()).unwrap();
    let (x, y) = set.batch(&tch::Tensor::from_slice(&[1i64])).unwrap();
    assert_eq!(x.size(), [1, 3, 32, 32]);
    assert_eq!(x.kind(), Kind::Float);
    assert_eq!(Vec::<i64>::try_from(&y).unwrap(), [5]);
    // Red channel, pixel (0, 0) = 50: (50/255 − 0.4914) / 0.2470.
    let expected = (50.0 / 255.0 - 0.4914) / 0.2470;
    assert!((x.double_value(&[0, 0, 0, 0]) - expected).abs() < 1e-5);
    let ones = normalize(&tch::Tensor::full(
        [1, 3, 1, 1],
        255,
        (Kind::Uint8, tch::Device::Cpu),
    ))
    .unwrap();
    assert!((ones.double_value(&[0, 2, 0, 0]) - (1.0 - 0.4465) / 0.2616).abs() < 1e-5);
}

#[test]
fn synthetic_data_is_cifar_shaped_and_reproducible() {
    let a = Cifar10::synthetic(64, 1).unwrap();
    let b = Cifar10::synthetic(64, 1).unwrap();
    assert_eq!(a.images.size(), [64, 3, 32, 32]);
    assert_eq!(a.images.kind(), Kind::Uint8);
    assert!(a.images.equal(&b.images) && a.labels.equal(&b.labels));
    assert!(a.labels.max().int64_value(&[]) < 10);
}

#[test]
fn synthetic_sets_with_different_seeds_share_the_class_patterns() {
    // Mean image per class, from two sets: the same patterns, up to the noise.
    let class_mean = |set: &Cifar10, class: i64| {
        let idx = set.labels.eq(class).nonzero().squeeze_dim(1);
        set.images
            .index_select(0, &idx)
            .to_kind(Kind::Float)
            .mean_dim(0, false, Kind::Float)
    };
    let (a, b) = (
        Cifar10::synthetic(4000, 1).unwrap(),
        Cifar10::synthetic(4000, 2).unwrap(),
    );
    assert!(!a.labels.equal(&b.labels));
    let same = (class_mean(&a, 3) - class_mean(&b, 3))
        .abs()
        .mean(Kind::Float)
        .double_value(&[]);
    let other = (class_mean(&a, 3) - class_mean(&b, 4))
        .abs()
        .mean(Kind::Float)
        .double_value(&[]);
    assert!(same < other / 2.0, "same class {same}, other class {other}");
}
