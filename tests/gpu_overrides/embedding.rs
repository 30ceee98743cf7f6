//! The embedding override under autocast against ATen's, and its declines.

use crate::common;
use speedkit::overrides::Override;
use tch::{Device, Kind, Tensor};

/// The output and the table's gradient of `embedding` under CUDA autocast (bf16) for a fixed
/// upstream gradient `dy`, with `padding_idx`.
fn embedding_pass(table: &Tensor, tokens: &Tensor, padding_idx: i64, dy: &Tensor) -> [Tensor; 2] {
    let table = table.detach().set_requires_grad(true);
    let y = speedkit::amp::autocast(table.device(), Kind::BFloat16, || {
        Tensor::embedding(&table, tokens, padding_idx, false, false)
    })
    .unwrap();
    (&y * dy).sum(Kind::Float).backward();
    [y.detach(), table.grad()]
}

/// Tokens of `shape` drawn from `vocab`, most of them repeated (a few tokens' rows gather many
/// positions), on `device`.
fn tokens(shape: &[i64], vocab: i64, device: Device) -> Tensor {
    let common_tokens = Tensor::randint(vocab.min(7), shape, (Kind::Int64, device));
    let rare = Tensor::randint(vocab, shape, (Kind::Int64, device));
    let pick = Tensor::rand(shape, (Kind::Float, device)).lt(0.5);
    common_tokens.where_self(&pick, &rare)
}

#[test]
fn embedding_under_autocast_matches_atens_forward_and_backward_on_odd_shapes() {
    let _serial = common::serial();
    let Some(device) = common::cuda_or_skip(
        "embedding_under_autocast_matches_atens_forward_and_backward_on_odd_shapes",
    ) else {
        return;
    };
    // A batch of sequences, a flat list of tokens, a vocabulary larger than its tokens and rows
    // of an odd width.
    for (shape, vocab, width) in [
        (vec![8, 129], 50304i64, 768i64),
        (vec![77], 1000, 37),
        (vec![3, 5, 7], 33000, 96),
    ] {
        let case = format!("{shape:?} tokens into [{vocab}, {width}]");
        let table = Tensor::randn([vocab, width], (Kind::Float, device));
        let ids = tokens(&shape, vocab, device);
        let mut y_shape = shape.clone();
        y_shape.push(width);
        let dy = Tensor::randn(y_shape.as_slice(), (Kind::Float, device));
        let expected = {
            let _off = common::hold_override(Override::Embedding, false);
            embedding_pass(&table, &ids, -1, &dy)
        };
        let _on = common::hold_override(Override::Embedding, true);
        let got = embedding_pass(&table, &ids, -1, &dy);
        let stats = Override::Embedding.stats("aten::embedding").unwrap();
        assert_eq!((stats.ran, stats.declined), (1, 0), "{case}: {stats:?}");
        assert_eq!(
            got[0].kind(),
            Kind::Float,
            "{case}: the table's type, as autocast"
        );
        assert!(got[0].equal(&expected[0]), "{case}: the gather");
        // The same fp32 sums of each token's positions, in another order than ATen's.
        let err = common::rel_err(&got[1], &expected[1]);
        assert!(
            err < 1e-6,
            "{case}: the table's gradient, relative error {err}"
        );
    }
}

#[test]
fn an_embedding_with_a_padding_index_runs_atens_and_is_counted() {
    let _serial = common::serial();
    let Some(device) =
        common::cuda_or_skip("an_embedding_with_a_padding_index_runs_atens_and_is_counted")
    else {
        return;
    };
    let table = Tensor::randn([100, 16], (Kind::Float, device));
    let ids = tokens(&[4, 9], 100, device);
    let dy = Tensor::randn([4, 9, 16], (Kind::Float, device));
    let expected = {
        let _off = common::hold_override(Override::Embedding, false);
        embedding_pass(&table, &ids, 3, &dy)
    };
    let _on = common::hold_override(Override::Embedding, true);
    let got = embedding_pass(&table, &ids, 3, &dy);
    let stats = Override::Embedding.stats("aten::embedding").unwrap();
    assert_eq!((stats.ran, stats.declined), (0, 1), "{stats:?}");
    assert!(got[0].equal(&expected[0]) && got[1].equal(&expected[1]));
}
