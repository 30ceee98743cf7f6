//! `LlamaTch`: a Llama-style decoder written with tch's own modules and ops, as a tch user ports
//! Meta's reference code: RMSNorm spelled out as `pow`/`mean`/`rsqrt`/`mul` in fp32, rotary
//! embeddings by `narrow`/`cat` ("rotate half"), a SwiGLU feed-forward, no biases, untied head.
//!
//! Like [`TchTransformer`](super::TchTransformer) it exists to measure what speedkit does for code
//! it did not write, here of another family than GPT-2: none of its chains (the norm, the rotary
//! embedding, SwiGLU) is one of speedkit's hand-written overrides.

use super::{cross_entropy, linear};
use speedkit::{Result, SpeedkitError};
use tch::{nn, Device, Kind, Tensor};

/// A Llama-style decoder's dimensions and batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlamaConfig {
    /// Vocabulary size.
    pub vocab: i64,
    /// Model width.
    pub d_model: i64,
    /// Attention heads (`d_model / heads` per head, even for the rotary embedding).
    pub heads: i64,
    /// Decoder blocks.
    pub layers: i64,
    /// Width of the SwiGLU feed-forward.
    pub hidden: i64,
    /// Tokens per sequence.
    pub seq_len: i64,
    /// Sequences per batch.
    pub batch: i64,
}

impl LlamaConfig {
    /// The reference size: d 1024, 16 heads of 64, 8 blocks, SwiGLU width 2816 (Llama's
    /// 8/3 · d rounded up to a multiple of 256), vocabulary 32000, 8 × 1024 tokens.
    pub const fn bench() -> Self {
        Self {
            vocab: 32000,
            d_model: 1024,
            heads: 16,
            layers: 8,
            hidden: 2816,
            seq_len: 1024,
            batch: 8,
        }
    }

    /// Llama 2 7B's shape on short sequences: d 4096, 32 heads of 128, 32 blocks, SwiGLU width
    /// 11008, vocabulary 32000 (6.74 B parameters), 2 × 512 tokens. Its fp32 weights, gradients
    /// and AdamW state, 16 bytes a parameter, do not fit one 80 GB GPU.
    pub const fn large() -> Self {
        Self {
            vocab: 32000,
            d_model: 4096,
            heads: 32,
            layers: 32,
            hidden: 11008,
            seq_len: 512,
            batch: 2,
        }
    }

    /// Parameters of the model: the embedding and the head, and per block four d × d
    /// projections, three d × hidden ones and two norms' scales; the final norm's.
    pub fn parameters(&self) -> i64 {
        let (d, h) = (self.d_model, self.hidden);
        2 * self.vocab * d + self.layers * (4 * d * d + 3 * d * h + 2 * d) + d
    }

    /// A CPU-test size: d 32, 2 heads, 2 blocks, width 88, vocabulary 128, 2 × 16 tokens.
    pub const fn tiny() -> Self {
        Self {
            vocab: 128,
            d_model: 32,
            heads: 2,
            layers: 2,
            hidden: 88,
            seq_len: 16,
            batch: 2,
        }
    }

    /// Tokens of one step.
    pub fn tokens_per_step(&self) -> i64 {
        self.batch * self.seq_len
    }

    /// Matmul FLOPs of one training step: per token and block 4·d² (q, k, v, o) and 3·d·hidden
    /// (SwiGLU), the head's d·vocab, and causal attention's two matmuls, all × 3 for forward and
    /// backward (the convention of [`TransformerConfig`](super::TransformerConfig)).
    pub fn flops_per_step(&self) -> f64 {
        let (b, t, d) = (self.batch as f64, self.seq_len as f64, self.d_model as f64);
        let per_token = self.layers as f64 * (4.0 * d * d + 3.0 * d * self.hidden as f64)
            + d * self.vocab as f64;
        6.0 * b * t * per_token + 3.0 * self.layers as f64 * 2.0 * b * t * t * d
    }

    fn check(&self) -> Result<()> {
        let positive = [
            self.vocab,
            self.d_model,
            self.heads,
            self.layers,
            self.hidden,
            self.seq_len,
            self.batch,
        ];
        if positive.iter().any(|&v| v <= 0) {
            return Err(SpeedkitError::Misuse(format!(
                "every dimension of a Llama config must be positive: {self:?}"
            )));
        }
        if self.d_model % self.heads != 0 || (self.d_model / self.heads) % 2 != 0 {
            return Err(SpeedkitError::Misuse(format!(
                "d_model {} must split into {} heads of an even width (the rotary embedding \
                 rotates pairs)",
                self.d_model, self.heads
            )));
        }
        Ok(())
    }
}

/// RMSNorm as Meta's reference writes it: `x · rsqrt(mean(x²) + eps)` in fp32, cast back, times a
/// learned scale.
#[derive(Debug)]
struct RmsNorm {
    weight: Tensor,
}

impl RmsNorm {
    const EPS: f64 = 1e-5;

    fn new(p: &nn::Path, d: i64) -> Self {
        Self {
            weight: p.var("weight", &[d], nn::Init::Const(1.0)),
        }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let xf = x.f_to_kind(Kind::Float)?;
        let mean_square =
            xf.f_pow_tensor_scalar(2)?
                .f_mean_dim(Some([-1i64].as_slice()), true, None)?;
        let normed = xf.f_mul(&mean_square.f_add_scalar(Self::EPS)?.f_rsqrt()?)?;
        Ok(normed.f_to_kind(x.kind())?.f_mul(&self.weight)?)
    }
}

/// The rotary embedding's cos and sin tables, `[seq_len, head_dim]` each (the frequencies
/// repeated for the two halves), made once on the model's device.
#[derive(Debug)]
struct Rotary {
    cos: Tensor,
    sin: Tensor,
}

impl Rotary {
    const BASE: f64 = 10000.0;

    fn new(seq_len: i64, head_dim: i64, device: Device) -> Result<Self> {
        let options = (Kind::Float, device);
        let exponents = Tensor::f_arange_start_step(0, head_dim, 2, options)?;
        let inv_freq = exponents
            .f_divide_scalar(head_dim as f64)?
            .f_mul_scalar(-Self::BASE.ln())?
            .f_exp()?;
        let positions = Tensor::f_arange(seq_len, options)?;
        let freqs = positions.f_outer(&inv_freq)?;
        let both = Tensor::f_cat(&[&freqs, &freqs], -1)?;
        Ok(Self {
            cos: both.f_cos()?,
            sin: both.f_sin()?,
        })
    }

    /// `x · cos + rotate_half(x) · sin` for `x` `[B, heads, T, head_dim]`.
    fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (t, half) = (x.size()[2], x.size()[3] / 2);
        let (x1, x2) = (x.f_narrow(-1, 0, half)?, x.f_narrow(-1, half, half)?);
        let rotated = Tensor::f_cat(&[&x2.f_neg()?, &x1], -1)?;
        let (cos, sin) = (self.cos.f_narrow(0, 0, t)?, self.sin.f_narrow(0, 0, t)?);
        let cos = cos.f_to_kind(x.kind())?;
        let sin = sin.f_to_kind(x.kind())?;
        Ok(x.f_mul(&cos)?.f_add(&rotated.f_mul(&sin)?)?)
    }
}

/// One block: `x + wo(attn(rope(wq·n(x)), rope(wk·n(x)), wv·n(x)))`, then
/// `x + w2(silu(w1·n(x)) · w3·n(x))`.
#[derive(Debug)]
struct Block {
    attention_norm: RmsNorm,
    wq: nn::Linear,
    wk: nn::Linear,
    wv: nn::Linear,
    wo: nn::Linear,
    ffn_norm: RmsNorm,
    w1: nn::Linear,
    w2: nn::Linear,
    w3: nn::Linear,
}

impl Block {
    fn new(p: &nn::Path, d: i64, hidden: i64) -> Self {
        let no_bias = nn::LinearConfig {
            bias: false,
            ..Default::default()
        };
        let lin = |name: &str, i: i64, o: i64| nn::linear(p / name, i, o, no_bias);
        Self {
            attention_norm: RmsNorm::new(&(p / "attention_norm"), d),
            wq: lin("wq", d, d),
            wk: lin("wk", d, d),
            wv: lin("wv", d, d),
            wo: lin("wo", d, d),
            ffn_norm: RmsNorm::new(&(p / "ffn_norm"), d),
            w1: lin("w1", d, hidden),
            w2: lin("w2", hidden, d),
            w3: lin("w3", d, hidden),
        }
    }

    fn forward(&self, x: &Tensor, heads: i64, rotary: &Rotary) -> Result<Tensor> {
        let (b, t, d) = x.size3()?;
        let h = self.attention_norm.forward(x)?;
        // [B, T, d] → [B, heads, T, head_dim], the layout SDPA takes.
        let split = |y: Tensor| -> Result<Tensor> {
            Ok(y.f_view([b, t, heads, d / heads])?.f_transpose(1, 2)?)
        };
        let q = rotary.apply(&split(linear(&self.wq, &h)?)?)?;
        let k = rotary.apply(&split(linear(&self.wk, &h)?)?)?;
        let v = split(linear(&self.wv, &h)?)?;
        let y = Tensor::f_scaled_dot_product_attention::<Tensor>(
            &q, &k, &v, None, 0.0, true, None, false,
        )?;
        let y = y.f_transpose(1, 2)?.f_reshape([b, t, d])?;
        let x = x.f_add(&linear(&self.wo, &y)?)?;
        let h = self.ffn_norm.forward(&x)?;
        let gate = linear(&self.w1, &h)?.f_silu()?;
        let up = linear(&self.w3, &h)?;
        Ok(x.f_add(&linear(&self.w2, &gate.f_mul(&up)?)?)?)
    }
}

/// The Llama-style decoder (see the [module docs](self)).
#[derive(Debug)]
pub struct LlamaTch {
    config: LlamaConfig,
    tok: nn::Embedding,
    rotary: Rotary,
    blocks: Vec<Block>,
    norm: RmsNorm,
    output: nn::Linear,
}

impl LlamaTch {
    /// Builds the model under `p`; fails if a dimension is not positive or the heads are not of
    /// an even width.
    pub fn new(p: &nn::Path, config: &LlamaConfig) -> Result<Self> {
        config.check()?;
        let d = config.d_model;
        let tok = nn::embedding(
            p / "tok_embeddings",
            config.vocab,
            d,
            nn::EmbeddingConfig {
                ws_init: nn::Init::Randn {
                    mean: 0.0,
                    stdev: 0.02,
                },
                ..Default::default()
            },
        );
        let blocks = (0..config.layers)
            .map(|i| Block::new(&(p / format!("layers{i}")), d, config.hidden))
            .collect();
        let output = nn::linear(
            p / "output",
            d,
            config.vocab,
            nn::LinearConfig {
                bias: false,
                ..Default::default()
            },
        );
        Ok(Self {
            config: *config,
            tok,
            rotary: Rotary::new(config.seq_len, d / config.heads, p.device())?,
            blocks,
            norm: RmsNorm::new(&(p / "norm"), d),
            output,
        })
    }

    /// The config the model was built with.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Logits `[B, T, vocab]` for token ids `[B, T]` (T at most `seq_len`).
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        let t = tokens.size().get(1).copied().unwrap_or(0);
        if tokens.dim() != 2 || t > self.config.seq_len {
            return Err(SpeedkitError::Misuse(format!(
                "tokens must be [batch, at most {}], not {:?}",
                self.config.seq_len,
                tokens.size()
            )));
        }
        let mut x = Tensor::f_embedding(&self.tok.ws, tokens, -1, false, false)?;
        for block in &self.blocks {
            x = block.forward(&x, self.config.heads, &self.rotary)?;
        }
        linear(&self.output, &self.norm.forward(&x)?)
    }

    /// Mean cross-entropy over the vocabulary of every position against `targets` `[B, T]`.
    pub fn loss(&self, tokens: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let logits = self.forward(tokens)?;
        cross_entropy(
            &logits.f_view([-1, self.config.vocab])?,
            &targets.f_reshape([-1])?,
        )
    }
}
