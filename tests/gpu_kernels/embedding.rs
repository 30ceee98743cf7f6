//! speedkit's token and position embedding against ATen's lookup, and its edge cases.

use crate::common::{self, cuda_or_skip};
use crate::support::{assert_close, assert_no_fallback, output_tolerance, KINDS};
use speedkit::nn::{embedding, embedding_fallback_reason};
use tch::{Kind, Tensor};

/// The embedding's forward equals ATen's lookup plus positions bit for bit, and its gradients
/// equal the fp32 reference's, for `tokens` [batch, seq] over a table of `vocab` rows.
fn embedding_matches_aten(kind: Kind, tokens: &Tensor, vocab: i64, width: i64, positions: bool) {
    let device = tokens.device();
    let seq = tokens.size()[1];
    let table = Tensor::randn([vocab, width], (Kind::Float, device))
        .to_kind(kind)
        .set_requires_grad(true);
    let position_table = Tensor::randn([seq + 3, width], (Kind::Float, device))
        .to_kind(kind)
        .set_requires_grad(true);
    let positions_arg = positions.then_some(&position_table);
    assert_eq!(
        embedding_fallback_reason(tokens, &table, positions_arg),
        None
    );
    let x = embedding(tokens, &table, positions_arg).unwrap();
    assert_no_fallback();
    let copy = |t: &Tensor| t.detach().set_requires_grad(true);
    let (t, p) = (copy(&table), copy(&position_table));
    let lookup_plus_positions = |table: &Tensor, positions_table: &Tensor| {
        let lookup = Tensor::embedding(table, tokens, -1, false, false);
        if positions {
            lookup + positions_table.narrow(0, 0, seq)
        } else {
            lookup
        }
    };
    let want = lookup_plus_positions(&t, &p);
    let case = format!("{kind:?} {:?} over {vocab}×{width}", tokens.size());
    assert!(x.equal(&want), "forward {case}");

    let dy = Tensor::randn(x.size(), (Kind::Float, device)).to_kind(kind);
    (x.to_kind(Kind::Float) * dy.to_kind(Kind::Float))
        .sum(Kind::Float)
        .backward();
    let (t32, p32) = (copy(&t.to_kind(Kind::Float)), copy(&p.to_kind(Kind::Float)));
    (lookup_plus_positions(&t32, &p32) * dy.to_kind(Kind::Float))
        .sum(Kind::Float)
        .backward();
    let tol = output_tolerance(kind);
    assert_close(&format!("dtable {case}"), &table.grad(), &t32.grad(), tol);
    if positions {
        assert_close(
            &format!("dpositions {case}"),
            &position_table.grad(),
            &p32.grad(),
            tol,
        );
    }
}

#[test]
fn embedding_matches_aten_forward_and_backward() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("embedding_matches_aten_forward_and_backward") else {
        return;
    };
    for kind in KINDS {
        for width in [1, 7, 33, 768, 1027, 2050] {
            for (batch, seq, vocab) in [(1, 1, 5), (3, 17, 40), (32, 128, 8192)] {
                // Few tokens over a large vocabulary leave most rows without a gradient; many over a
                // small one repeat each token dozens of times.
                let tokens = Tensor::randint(vocab, [batch, seq], (Kind::Int64, device));
                for positions in [false, true] {
                    embedding_matches_aten(kind, &tokens, vocab, width, positions);
                }
            }
        }
    }
}

#[test]
fn embedding_of_one_token_everywhere_sums_every_row_in_order() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("embedding_of_one_token_everywhere_sums_every_row_in_order")
    else {
        return;
    };
    let tokens = Tensor::full([64, 256], 7, (Kind::Int64, device));
    embedding_matches_aten(Kind::Float, &tokens, 10, 768, true);
}

#[test]
fn embedding_of_strided_tokens_equals_that_of_contiguous_ones() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("embedding_of_strided_tokens_equals_that_of_contiguous_ones")
    else {
        return;
    };
    let table = Tensor::randn([100, 64], (Kind::Float, device));
    let positions = Tensor::randn([16, 64], (Kind::Float, device));
    let tokens = Tensor::randint(100, [16, 4], (Kind::Int64, device)).transpose(0, 1);
    assert!(!tokens.is_contiguous());
    let strided = embedding(&tokens, &table, Some(&positions)).unwrap();
    let contiguous = embedding(&tokens.contiguous(), &table, Some(&positions)).unwrap();
    assert!(strided.equal(&contiguous));
}

#[test]
fn embedding_of_an_empty_batch_gives_zero_gradients() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("embedding_of_an_empty_batch_gives_zero_gradients") else {
        return;
    };
    let table = Tensor::randn([10, 8], (Kind::Float, device)).set_requires_grad(true);
    let positions = Tensor::randn([4, 8], (Kind::Float, device)).set_requires_grad(true);
    let tokens = Tensor::zeros([0, 4], (Kind::Int64, device));
    let x = embedding(&tokens, &table, Some(&positions)).unwrap();
    assert_eq!(x.size(), [0, 4, 8]);
    x.sum(Kind::Float).backward();
    assert_eq!(table.grad().abs().sum(Kind::Float).double_value(&[]), 0.0);
    assert_eq!(
        positions.grad().abs().sum(Kind::Float).double_value(&[]),
        0.0
    );
}

#[test]
fn embedding_backward_is_bitwise_reproducible() {
    let _serial = common::serial();
    let Some(device) = cuda_or_skip("embedding_backward_is_bitwise_reproducible") else {
        return;
    };
    let table = Tensor::randn([512, 768], (Kind::Float, device)).set_requires_grad(true);
    let positions = Tensor::randn([256, 768], (Kind::Float, device)).set_requires_grad(true);
    let tokens = Tensor::randint(512, [32, 256], (Kind::Int64, device));
    let dy = Tensor::randn([32, 256, 768], (Kind::Float, device));
    let grads = || {
        table.shallow_clone().zero_grad();
        positions.shallow_clone().zero_grad();
        (embedding(&tokens, &table, Some(&positions)).unwrap() * &dy)
            .sum(Kind::Float)
            .backward();
        (table.grad().copy(), positions.grad().copy())
    };
    let (first, second) = (grads(), grads());
    assert!(first.0.equal(&second.0) && first.1.equal(&second.1));
}
