//! `Transformer`: a GPT-style pre-LayerNorm decoder trained on next-token cross-entropy.

use speedkit::checkpoint::Checkpointer;
use speedkit::nn::{cross_entropy, layer_norm, LayerNorm, Linear};
use speedkit::{Result, SpeedkitError};
use tch::nn::Module;
use tch::{nn, Tensor};

/// Dimensions of [`Transformer`] and of its batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransformerConfig {
    /// Vocabulary size (token embedding rows and output classes).
    pub vocab: i64,
    /// Model width.
    pub d_model: i64,
    /// Attention heads; must divide `d_model`.
    pub heads: i64,
    /// Decoder blocks.
    pub layers: i64,
    /// Sequence length, also the size of the learned position embedding.
    pub seq_len: i64,
    /// Sequences per batch.
    pub batch: i64,
}

impl TransformerConfig {
    /// The reference size: vocab 8192, d 768, 12 heads of 64, 6 layers, batch 32 × 512 tokens.
    pub const fn bench() -> Self {
        Self {
            vocab: 8192,
            d_model: 768,
            heads: 12,
            layers: 6,
            seq_len: 512,
            batch: 32,
        }
    }

    /// A CPU-test size: vocab 128, d 32, 2 heads, 2 layers, batch 2 × 16 tokens.
    pub const fn tiny() -> Self {
        Self {
            vocab: 128,
            d_model: 32,
            heads: 2,
            layers: 2,
            seq_len: 16,
            batch: 2,
        }
    }

    /// Width of one attention head.
    pub const fn head_dim(&self) -> i64 {
        self.d_model / self.heads
    }

    /// Tokens in one batch (the throughput unit).
    pub const fn tokens_per_step(&self) -> i64 {
        self.batch * self.seq_len
    }

    /// Weights that take part in matmuls: per block 12·d² (qkv 3d², output projection d², MLP
    /// 4d² + 4d²) plus the output head d·vocab. Biases, norms and embeddings (lookups, not
    /// matmuls) are not counted. 6 · 7 077 888 + 6 291 456 at the bench size.
    pub const fn matmul_params(&self) -> i64 {
        self.layers * 12 * self.d_model * self.d_model + self.d_model * self.vocab
    }

    /// Matmul FLOPs of one training step (forward + backward), as `docs/workloads.md` counts them:
    ///
    /// `6·B·T·P + 3·L·2·B·T²·d`
    ///
    /// with `P` = [`matmul_params`](Self::matmul_params) (each weight does a multiply-add per
    /// token: 2 FLOPs forward, 4 backward), and per layer the causal attention's `q·kᵀ` and
    /// `softmax·v` (2·B·T²·d each in full, halved by the causal mask, × 3 for the backward).
    /// The formula holds for any config; at the bench size it is
    /// 6·32·512·(6·7 077 888 + 6 291 456) + 3·6·2·32·512²·768 ≈ 5.02 TFLOP.
    pub fn flops_per_step(&self) -> f64 {
        let (b, t, d, l) = (
            self.batch as f64,
            self.seq_len as f64,
            self.d_model as f64,
            self.layers as f64,
        );
        6.0 * b * t * self.matmul_params() as f64 + 3.0 * l * 2.0 * b * t * t * d
    }

    /// Refuses token ids `[B, T]` longer than the position embedding.
    pub(super) fn check_tokens(&self, tokens: &Tensor) -> Result<i64> {
        let (_, t) = tokens.size2()?;
        if t > self.seq_len {
            return Err(SpeedkitError::Misuse(format!(
                "sequence of {t} tokens is longer than the position embedding ({})",
                self.seq_len
            )));
        }
        Ok(t)
    }

    pub(super) fn check(&self) -> Result<()> {
        let positive = [
            self.vocab,
            self.d_model,
            self.heads,
            self.layers,
            self.seq_len,
            self.batch,
        ];
        if positive.iter().any(|&v| v <= 0) {
            return Err(SpeedkitError::Misuse(format!(
                "every transformer dimension must be positive: {self:?}"
            )));
        }
        if self.d_model % self.heads != 0 {
            return Err(SpeedkitError::Misuse(format!(
                "d_model {} is not divisible by {} heads",
                self.d_model, self.heads
            )));
        }
        Ok(())
    }
}

/// One pre-LN decoder block: `x + proj(attn(LN(x)))`, then `x + fc2(gelu(fc1(LN(x))))`.
///
/// Each residual add is fused into the LayerNorm that follows it ([`LayerNorm::forward_residual`]):
/// a block takes the residual stream and the previous block's MLP output still to be added, and
/// returns the same pair for the next one.
#[derive(Debug)]
struct Block {
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl Block {
    fn new(p: &nn::Path, d: i64) -> Self {
        let ln = |name: &str| layer_norm(p / name, d, Default::default());
        let lin = |name: &str, i: i64, o: i64| Linear::new(&(p / name), i, o, true);
        Self {
            ln1: ln("ln1"),
            qkv: lin("qkv", d, 3 * d),
            proj: lin("proj", d, d),
            ln2: ln("ln2"),
            fc1: lin("fc1", d, 4 * d),
            fc2: lin("fc2", 4 * d, d),
        }
    }

    /// `(stream, pending)` → the next block's `(stream, pending)`, where the block's input is
    /// `stream + pending` (`pending` is `None` for the first block).
    fn forward(
        &self,
        stream: &Tensor,
        pending: Option<&Tensor>,
        heads: i64,
    ) -> Result<(Tensor, Tensor)> {
        let (b, t, d) = stream.size3()?;
        let (h, x) = match pending {
            Some(delta) => self.ln1.forward_residual(stream, delta),
            None => self.ln1.forward_keeping_input(stream),
        };
        let parts = self.qkv.forward_chunks(&h, 3)?;
        // [B, T, d] → [B, heads, T, head_dim], the layout SDPA takes.
        let split = |part: &Tensor| -> Result<Tensor> {
            Ok(part.f_view([b, t, heads, d / heads])?.f_transpose(1, 2)?)
        };
        let [q, k, v] = [split(&parts[0])?, split(&parts[1])?, split(&parts[2])?];
        let y = speedkit::nn::attention(&q, &k, &v, true)?;
        let y = y.f_transpose(1, 2)?.f_reshape([b, t, d])?;
        let (h, x) = self.ln2.forward_residual(&x, &self.proj.forward_t(&y)?);
        let m = self.fc2.forward_t(&self.fc1.forward_gelu(&h)?)?;
        Ok((x, m))
    }
}

/// The GPT-style decoder of `docs/workloads.md`: token + learned position embeddings, pre-LN blocks
/// with causal scaled-dot-product attention ([`speedkit::nn::attention`], so the `sdp_backend` flags
/// pick the kernel), a final LayerNorm and an output head without bias.
///
/// Built on [`speedkit::nn`]'s modules, which run speedkit's fused kernels where the plan turns
/// them on (`kernels`: the token and position embeddings in one kernel each way, LayerNorm fused
/// with the residual add, the fused cross-entropy) and FP8
/// GEMMs where it turns FP8 on, and ATen's composite ops anywhere else. The parameters keep tch's
/// names (`block0.ln1.weight`, `head.weight`, ...).
#[derive(Debug)]
pub struct Transformer {
    config: TransformerConfig,
    tok: Tensor,
    pos: Tensor,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    head: Linear,
}

impl Transformer {
    /// Builds the model under `p`; fails if `d_model` is not a multiple of `heads`.
    pub fn new(p: &nn::Path, config: &TransformerConfig) -> Result<Self> {
        config.check()?;
        let d = config.d_model;
        // GPT-2's initialisation of the embeddings (tch's default is N(0, 1)).
        let init = nn::Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        let tok = p.f_var("tok_emb", &[config.vocab, d], init)?;
        let pos = p.f_var("pos_emb", &[config.seq_len, d], init)?;
        let blocks = (0..config.layers)
            .map(|i| Block::new(&(p / format!("block{i}")), d))
            .collect();
        let ln_f = layer_norm(p / "ln_f", d, Default::default());
        let head = Linear::new(&(p / "head"), d, config.vocab, false);
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
        self.forward_with(tokens, None)
    }

    /// Mean cross-entropy over the vocabulary of every position against `targets` `[B, T]`.
    pub fn loss(&self, tokens: &Tensor, targets: &Tensor) -> Result<Tensor> {
        self.loss_with(tokens, targets, None)
    }

    /// [`loss`](Self::loss) with every block checkpointed in `ck`: the same value and gradients,
    /// with one block's activations alive at a time (each block runs again in the backward).
    pub fn loss_checkpointed<'env>(
        &'env self,
        ck: &Checkpointer<'env>,
        tokens: &Tensor,
        targets: &Tensor,
    ) -> Result<Tensor> {
        self.loss_with(tokens, targets, Some(ck))
    }

    fn loss_with<'env>(
        &'env self,
        tokens: &Tensor,
        targets: &Tensor,
        ck: Option<&Checkpointer<'env>>,
    ) -> Result<Tensor> {
        let logits = self.forward_with(tokens, ck)?;
        let flat = logits.f_view([-1, self.config.vocab])?;
        Ok(cross_entropy(&flat, &targets.f_reshape([-1])?))
    }

    fn forward_with<'env>(
        &'env self,
        tokens: &Tensor,
        ck: Option<&Checkpointer<'env>>,
    ) -> Result<Tensor> {
        self.config.check_tokens(tokens)?;
        let mut stream = speedkit::nn::embedding(tokens, &self.tok, Some(&self.pos))?;
        let mut pending: Option<Tensor> = None;
        let heads = self.config.heads;
        for block in &self.blocks {
            match ck {
                None => {
                    let (next, delta) = block.forward(&stream, pending.as_ref(), heads)?;
                    (stream, pending) = (next, Some(delta));
                }
                // A checkpoint keeps its inputs until the backward reaches it: the block's whole
                // output, summed inside it, rather than the stream and the MLP's output that the
                // next LayerNorm would add (a third more per block).
                Some(ck) => {
                    let out = ck.checkpoint(&[&stream], move |i| {
                        let (next, delta) = block.forward(&i[0], None, heads)?;
                        Ok(vec![next.f_add(&delta)?])
                    })?;
                    stream = out.into_iter().next().ok_or_else(|| {
                        SpeedkitError::Misuse("a checkpointed block hands back its output".into())
                    })?;
                }
            }
        }
        let x = match &pending {
            Some(delta) => self.ln_f.forward_residual(&stream, delta).0,
            None => self.ln_f.forward(&stream),
        };
        self.head.forward_t(&x)
    }
}
