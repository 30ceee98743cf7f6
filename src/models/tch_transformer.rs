//! `TchTransformer`: the GPT-style decoder of [`Transformer`](super::Transformer) written with
//! tch's own modules and ops only, as a tch user who has never heard of speedkit writes it.
//!
//! It exists to measure what speedkit does for code it did not write: no `speedkit::nn` module,
//! so none of speedkit's fused kernels or FP8 GEMMs run inside the model, only what the plan sets
//! around it (precision flags, autocast, the optimizer, CUDA graphs, the SDPA backend flags).

use super::transformer::TransformerConfig;
use super::{layer_norm, linear, self_attention, PreLnBlock};
use speedkit::{Result, SpeedkitError};
use tch::{nn, Kind, Tensor};

/// GPT-2 small at a 1024-token context: vocab 50304 (50257 rounded up to a multiple of 64, as
/// nanoGPT pads it for Tensor Core tiles), d 768, 12 heads of 64, 12 layers, batch 8.
///
/// A free function because [`TransformerConfig`]'s constructors are the `transformer` workload's;
/// this size belongs to the `gpt2` and `gpt2_tch` workloads.
pub const fn gpt2_small() -> TransformerConfig {
    TransformerConfig {
        vocab: 50304,
        d_model: 768,
        heads: 12,
        layers: 12,
        seq_len: 1024,
        batch: 8,
    }
}

/// One pre-LN decoder block: `x + proj(attn(LN(x)))`, then `x + fc2(gelu(fc1(LN(x))))`.
fn decoder_block(m: &PreLnBlock, x: &Tensor, heads: i64) -> Result<Tensor> {
    let qkv = linear(&m.qkv, &layer_norm(&m.ln1, x)?)?;
    let y = self_attention(&qkv, heads, true)?;
    let x = x.f_add(&linear(&m.proj, &y)?)?;
    let h = linear(&m.fc1, &layer_norm(&m.ln2, &x)?)?.f_gelu("tanh")?;
    Ok(x.f_add(&linear(&m.fc2, &h)?)?)
}

/// The decoder of `docs/workloads.md` built from tch's `nn::embedding`, `nn::layer_norm` and
/// `nn::linear`, with causal `Tensor::scaled_dot_product_attention` and a loss from
/// `Tensor::cross_entropy_for_logits`'s ops: the architecture, initialisation and FLOPs of
/// [`Transformer`](super::Transformer), with every op ATen's stock one.
///
/// The modules are applied through the fallible forms of the ops their `Module::forward` calls
/// (`f_embedding`, `f_linear`, `f_layer_norm` on their public weights), so a libtorch error comes
/// back as a value, as from every model of this crate; the kernels that run are the same.
#[derive(Debug)]
pub struct TchTransformer {
    config: TransformerConfig,
    tok: nn::Embedding,
    pos: Tensor,
    blocks: Vec<PreLnBlock>,
    ln_f: nn::LayerNorm,
    head: nn::Linear,
}

impl TchTransformer {
    /// Builds the model under `p`; fails if a dimension is not positive or `d_model` is not a
    /// multiple of `heads`.
    pub fn new(p: &nn::Path, config: &TransformerConfig) -> Result<Self> {
        config.check()?;
        let d = config.d_model;
        // GPT-2's initialisation of the embeddings (tch's default is N(0, 1)); the linears and
        // LayerNorms keep tch's defaults, which are PyTorch's.
        let init = nn::Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        let tok = nn::embedding(
            p / "tok_emb",
            config.vocab,
            d,
            nn::EmbeddingConfig {
                ws_init: init,
                ..Default::default()
            },
        );
        // A plain variable sliced to the sequence, as the PyTorch reference adds its `pos`: no
        // `arange` of positions to look up, and a slice's backward instead of a scatter.
        let pos = p.f_var("pos_emb", &[config.seq_len, d], init)?;
        let blocks = (0..config.layers)
            .map(|i| PreLnBlock::new(&(p / format!("block{i}")), d))
            .collect();
        let ln_f = nn::layer_norm(p / "ln_f", vec![d], Default::default());
        let head = nn::linear(
            p / "head",
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
            pos,
            blocks,
            ln_f,
            head,
        })
    }

    /// The config the model was built with.
    pub fn config(&self) -> &TransformerConfig {
        &self.config
    }

    /// Logits `[B, T, vocab]` for token ids `[B, T]` (T at most `seq_len`).
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        let t = self.config.check_tokens(tokens)?;
        let tok = Tensor::f_embedding(&self.tok.ws, tokens, -1, false, false)?;
        let mut x = tok.f_add(&self.pos.f_narrow(0, 0, t)?)?;
        for block in &self.blocks {
            x = decoder_block(block, &x, self.config.heads)?;
        }
        linear(&self.head, &layer_norm(&self.ln_f, &x)?)
    }

    /// Mean cross-entropy over the vocabulary of every position against `targets` `[B, T]`.
    pub fn loss(&self, tokens: &Tensor, targets: &Tensor) -> Result<Tensor> {
        if targets.size() != tokens.size() {
            return Err(SpeedkitError::Misuse(format!(
                "targets {:?} do not match tokens {:?}",
                targets.size(),
                tokens.size()
            )));
        }
        let logits = self.forward(tokens)?;
        let flat = logits.f_view([-1, self.config.vocab])?;
        // `cross_entropy_for_logits`, spelled out in its fallible ops (the panicking form would end
        // the process on an out-of-memory, where a caller can recover from an error).
        Ok(flat.f_log_softmax(-1, Kind::Float)?.f_nll_loss(
            &targets.f_reshape([-1])?,
            None::<&Tensor>,
            tch::Reduction::Mean,
            -100,
        )?)
    }
}
