//! Sharded checkpoints, as PyTorch's `torch.distributed.checkpoint`: every rank writes its own part
//! of the model and of AdamW's state into one directory, at the same time, and a load reads on each
//! rank only the stretches its own part needs, whatever the number of ranks that wrote them. A
//! model that no GPU holds whole (`distributed.shard_parameters`) is saved and restored without
//! ever being gathered, and a checkpoint moves between world sizes, and to and from one process.
//!
//! The directory holds `rank{R}-of-{N}.safetensors` for every rank R of N. Each file's tensors are
//! flat stretches of the model's variables (`param/NAME`) and of AdamW's state for them
//! (`exp_avg/NAME`, `exp_avg_sq/NAME`, and `step/NAME`, the stretch's step count); the file's
//! metadata says where each stretch starts in its variable's flattened values, and the variable's
//! shape. What a rank writes: under a sharded optimizer or sharded parameters, the pieces of the
//! parameters it owns; otherwise (every rank holding the whole model) its N-th of each variable,
//! so that the ranks share the writing.
//!
//! ```
//! use speedkit::{SpeedConfig, SpeedContext};
//! use tch::{nn, Device};
//! let ctx = SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu\n")?)?;
//! let vs = nn::VarStore::new(Device::Cpu);
//! let _layer = nn::linear(vs.root() / "layer", 4, 2, Default::default());
//! let mut opt = ctx.adamw(&vs, Default::default())?;
//! let dir = std::env::temp_dir().join("speedkit-doc-sharded-checkpoint");
//! ctx.save_sharded(&vs, Some(&opt), &dir)?;         // every rank: its own file
//! ctx.load_sharded(&vs, Some(&mut opt), &dir)?;     // every rank: what its part needs
//! let whole = speedkit::dist::read_sharded_checkpoint(&dir)?;   // the model, whole, on the CPU
//! assert_eq!(whole.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["layer.bias", "layer.weight"]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, Metadata, View};
use tch::{nn::VarStore, Device, Kind, Tensor};

use super::DataParallel;
use crate::error::{Result, SpeedkitError};
use crate::optim::AdamWOptimizer;

/// The kinds of stretch a checkpoint holds, as its tensors' name prefixes.
const PARAM: &str = "param";
const STATE: [&str; 3] = ["exp_avg", "exp_avg_sq", "step"];

/// One flat stretch of a variable that this rank writes or fills.
struct Part {
    name: String,
    /// The whole variable's shape.
    shape: Vec<i64>,
    /// Where the stretch starts in the variable's flattened values.
    offset: i64,
    /// The stretch: a flat view of the values this rank holds.
    values: Tensor,
    /// The tensor an optimizer updates for it (the piece itself, or the whole variable) and where
    /// the stretch starts in that tensor's flattened values.
    owner: Tensor,
    within: i64,
}

/// Where one stretch lies in a checkpoint's files.
struct Stored {
    file: PathBuf,
    /// Its first byte in the file, its type and where it starts in its variable.
    at: u64,
    dtype: Dtype,
    offset: i64,
    len: i64,
    shape: Vec<i64>,
}

/// Every stretch of a checkpoint, by tensor name (`param/NAME`, `exp_avg/NAME`, ...), and the
/// learning rates it was written with.
struct Index {
    stored: BTreeMap<String, Vec<Stored>>,
    lrs: Vec<f64>,
}

/// Writes this rank's part of the model (and of `optimizer`'s state) into `dir`.
pub(crate) fn save(
    dp: Option<&DataParallel>,
    rank: usize,
    world: usize,
    vs: &VarStore,
    optimizer: Option<&AdamWOptimizer>,
    dir: &Path,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| SpeedkitError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let parts = parts_to_write(owned(dp)?, rank, world, vs)?;
    let mut tensors: Vec<(String, Stretch)> = Vec::new();
    let mut metadata = HashMap::new();
    let mut add = |key: String, part: &Part, values: &Tensor| -> Result<()> {
        let placement = serde_json::json!({ "offset": part.offset, "shape": part.shape });
        metadata.insert(key.clone(), placement.to_string());
        tensors.push((key, Stretch::of(values)?));
        Ok(())
    };
    for part in &parts {
        add(format!("{PARAM}/{}", part.name), part, &part.values)?;
    }
    if let Some(optimizer) = optimizer {
        let states = optimizer.param_states()?;
        for part in &parts {
            // A variable the optimizer does not update has no state.
            let Some(state) = states.iter().find(|s| same_tensor(&s[0], &part.owner)) else {
                continue;
            };
            for (kind, t) in STATE.iter().zip(&state[1..]) {
                add(
                    format!("{kind}/{}", part.name),
                    part,
                    &state_stretch(kind, t, part)?,
                )?;
            }
        }
        metadata.insert(
            "speedkit.lr".into(),
            serde_json::json!(optimizer.lrs()).to_string(),
        );
    }
    metadata.insert("speedkit.ranks".into(), world.to_string());
    let path = dir.join(file_name(rank, world));
    let views = tensors.iter().map(|(key, stretch)| (key.as_str(), stretch));
    safetensors::tensor::serialize_to_file(views, &Some(metadata), &path)
        .map_err(|e| SpeedkitError::Misuse(format!("writing {}: {e}", path.display())))?;
    match tensors
        .iter()
        .find_map(|(_, s)| s.failed.borrow_mut().take())
    {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// Reads into this rank's part of the model (and of `optimizer`'s state) what `dir` holds for it.
pub(crate) fn load(
    dp: Option<&DataParallel>,
    vs: &VarStore,
    optimizer: Option<&mut AdamWOptimizer>,
    dir: &Path,
) -> Result<()> {
    let index = Index::read(dir)?;
    index.check_variables(vs, dir)?;
    if optimizer.is_some() {
        index.check_optimizer_state(vs, dir)?;
    }
    let (model, pieces) = parts_to_fill(owned(dp)?, vs)?;
    let _no_grad = tch::no_grad_guard();
    for part in &model {
        index.fill(&format!("{PARAM}/{}", part.name), part.offset, &part.values)?;
    }
    if let Some(optimizer) = optimizer {
        // Under ZeRO-1 the optimizer updates this rank's pieces of the whole variables read above.
        let parts = pieces.as_deref().unwrap_or(&model);
        let states = optimizer.make_param_states()?;
        for part in parts {
            let Some(state) = states.iter().find(|s| same_tensor(&s[0], &part.owner)) else {
                continue;
            };
            for (kind, t) in STATE.iter().zip(&state[1..]) {
                let key = format!("{kind}/{}", part.name);
                if *kind == "step" {
                    // Every stretch of a variable was stepped as often: any one says how often.
                    let stored = index.stored.get(&key).and_then(|s| s.first());
                    let stored = stored.ok_or_else(|| lacks(&key, dir))?;
                    t.shallow_clone()
                        .f_copy_(&read(stored, 0, 1)?.f_reshape([])?)?;
                } else {
                    index.fill(&key, part.offset, &state_stretch(kind, t, part)?)?;
                }
            }
        }
        for (group, lr) in index.lrs.iter().enumerate().take(optimizer.lrs().len()) {
            optimizer.set_group_lr(group, *lr)?;
        }
    }
    dp.map_or(Ok(()), DataParallel::refresh_parameters)
}

/// The stretch of one of AdamW's state tensors `t` that goes with `part`: the moments' values over
/// the part's elements, or the step count.
fn state_stretch(kind: &str, t: &Tensor, part: &Part) -> Result<Tensor> {
    Ok(if kind == "step" {
        t.f_reshape([1])?
    } else {
        t.f_view([-1])?
            .f_narrow(0, part.within, part.values.numel() as i64)?
    })
}

/// Every variable of the checkpoint in `dir`, whole, on the CPU, in its stored type, by name:
/// the model a sharded checkpoint holds, assembled from every rank's file (to save as one file,
/// or to look at).
///
/// ```
/// use speedkit::{SpeedConfig, SpeedContext};
/// use tch::{nn, Device};
/// let ctx = SpeedContext::new(&SpeedConfig::from_yaml_str("device: cpu\n")?)?;
/// let vs = nn::VarStore::new(Device::Cpu);
/// let _layer = nn::linear(vs.root() / "layer", 4, 2, Default::default());
/// let dir = std::env::temp_dir().join("speedkit-doc-read-sharded");
/// ctx.save_sharded(&vs, None, &dir)?;
/// let whole = speedkit::dist::read_sharded_checkpoint(&dir)?;
/// tch::Tensor::save_multi(&whole, std::env::temp_dir().join("model-whole.ot"))?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn read_sharded_checkpoint(dir: impl AsRef<Path>) -> Result<Vec<(String, Tensor)>> {
    let dir = dir.as_ref();
    let index = Index::read(dir)?;
    let mut out = Vec::new();
    for (key, stored) in &index.stored {
        let Some(name) = key.strip_prefix(&format!("{PARAM}/")) else {
            continue;
        };
        let shape = stored[0].shape.clone();
        let kind = kind_of(stored[0].dtype)?;
        let whole = Tensor::f_empty(&shape, (kind, Device::Cpu))?;
        index.fill(key, 0, &whole.f_view([-1])?)?;
        out.push((name.to_string(), whole));
    }
    Ok(out)
}

// ----- what a rank holds ---------------------------------------------------------------------------

/// The pieces of the parameters this rank owns under ZeRO-1 or ZeRO-3 (none otherwise), the
/// names of every parameter the pieces are cut from (this rank's or another's), and whether those
/// parameters are sharded (ZeRO-3: the pieces are the only values this rank holds of them).
struct Owned {
    parts: Vec<Part>,
    names: Vec<String>,
    parameters_sharded: bool,
}

fn owned(dp: Option<&DataParallel>) -> Result<Owned> {
    let Some(owned) = dp.map(DataParallel::owned_pieces).transpose()?.flatten() else {
        return Ok(Owned {
            parts: Vec::new(),
            names: Vec::new(),
            parameters_sharded: false,
        });
    };
    let whole = owned.shard.parameters();
    let pieces = owned.shard.pieces().iter().zip(owned.shard.piece_offsets());
    let parts = pieces
        .map(|((piece, param), offset)| Part {
            name: owned.names[*param].clone(),
            shape: whole[*param].size(),
            offset: *offset,
            values: piece.shallow_clone(),
            owner: piece.shallow_clone(),
            within: 0,
        })
        .collect();
    Ok(Owned {
        parts,
        names: owned.names,
        parameters_sharded: owned.parameters_sharded,
    })
}

/// The stretches this rank writes: the pieces it owns of sharded parameters or optimizer, and its
/// N-th of every other variable.
fn parts_to_write(owned: Owned, rank: usize, world: usize, vs: &VarStore) -> Result<Vec<Part>> {
    let mut parts = owned.parts;
    for (name, var) in variables(vs) {
        if owned.names.contains(&name) {
            continue;
        }
        let numel = var.numel() as i64;
        let chunk = (numel + world as i64 - 1) / world as i64;
        let begin = (rank as i64 * chunk).min(numel);
        let end = (begin + chunk).min(numel);
        if begin < end {
            let values = var
                .detach()
                .f_reshape([-1])?
                .f_narrow(0, begin, end - begin)?;
            parts.push(Part {
                name,
                shape: var.size(),
                offset: begin,
                values,
                owner: var,
                within: begin,
            });
        }
    }
    Ok(parts)
}

/// The stretches this rank reads the model into: under ZeRO-3 its pieces of the sharded
/// parameters and every other variable whole; otherwise every variable whole. Beside them, under
/// ZeRO-1, the pieces its optimizer updates.
fn parts_to_fill(owned: Owned, vs: &VarStore) -> Result<(Vec<Part>, Option<Vec<Part>>)> {
    let mut parts = Vec::new();
    for (name, var) in variables(vs) {
        if owned.parameters_sharded && owned.names.contains(&name) {
            continue;
        }
        let values = var.detach().f_view([-1]).map_err(|_| {
            SpeedkitError::Misuse(format!(
                "variable `{name}` is not contiguous: a checkpoint cannot be read into it in place"
            ))
        })?;
        parts.push(Part {
            name,
            shape: var.size(),
            offset: 0,
            values,
            owner: var,
            within: 0,
        });
    }
    if owned.parameters_sharded {
        parts.extend(owned.parts);
        return Ok((parts, None));
    }
    let pieces = (!owned.parts.is_empty()).then_some(owned.parts);
    Ok((parts, pieces))
}

fn variables(vs: &VarStore) -> Vec<(String, Tensor)> {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

fn same_tensor(a: &Tensor, b: &Tensor) -> bool {
    a.data_ptr() == b.data_ptr() && a.size() == b.size()
}

// ----- the files -------------------------------------------------------------------------------------

fn file_name(rank: usize, world: usize) -> String {
    format!("rank{rank:05}-of-{world:05}.safetensors")
}

/// A stretch on its way to a file, copied off the device only as the file is written, so that a
/// rank never holds a second copy of its whole part in host memory. A copy that fails is kept to
/// be reported after the write.
struct Stretch {
    values: Tensor,
    dtype: Dtype,
    len: usize,
    failed: std::cell::RefCell<Option<tch::TchError>>,
}

impl Stretch {
    fn of(values: &Tensor) -> Result<Self> {
        Ok(Self {
            dtype: dtype_of(values.kind())?,
            len: values.numel(),
            values: values.shallow_clone(),
            failed: std::cell::RefCell::new(None),
        })
    }

    fn bytes(&self) -> std::result::Result<Vec<u8>, tch::TchError> {
        let host = self.values.f_to_device(Device::Cpu)?.f_contiguous()?;
        let mut bytes = vec![0u8; self.data_len()];
        host.f_copy_data_u8(&mut bytes, self.len)?;
        Ok(bytes)
    }
}

impl View for &Stretch {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        std::slice::from_ref(&self.len)
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let bytes = self.bytes().unwrap_or_else(|e| {
            self.failed.borrow_mut().get_or_insert(e);
            vec![0u8; self.data_len()]
        });
        std::borrow::Cow::Owned(bytes)
    }
    fn data_len(&self) -> usize {
        self.len * self.values.kind().elt_size_in_bytes()
    }
}

impl Index {
    /// The headers of every file in `dir`, which must be all N of one checkpoint.
    fn read(dir: &Path) -> Result<Self> {
        let entries = std::fs::read_dir(dir).map_err(|source| SpeedkitError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("rank") && n.ends_with(".safetensors"))
            })
            .collect();
        files.sort();
        let Some(first) = files.first() else {
            return Err(SpeedkitError::Misuse(format!(
                "{} holds no sharded checkpoint (rank*-of-*.safetensors files, as SpeedContext::save_sharded writes)",
                dir.display()
            )));
        };
        let world = header(first)?
            .1
            .metadata()
            .as_ref()
            .and_then(|m| m.get("speedkit.ranks"))
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or(0);
        let expected: Vec<PathBuf> = (0..world).map(|r| dir.join(file_name(r, world))).collect();
        if world == 0 || files != expected {
            return Err(SpeedkitError::Misuse(format!(
                "{} is not one whole sharded checkpoint: it holds {} rank file(s), and {} names {} rank(s); each of ranks 0..N writes rank{{R}}-of-{{N}}.safetensors",
                dir.display(),
                files.len(),
                first.display(),
                world
            )));
        }
        let mut index = Index {
            stored: BTreeMap::new(),
            lrs: Vec::new(),
        };
        for file in files {
            index.add_file(&file)?;
        }
        for stored in index.stored.values_mut() {
            stored.sort_by_key(|s| s.offset);
        }
        Ok(index)
    }

    fn add_file(&mut self, file: &Path) -> Result<()> {
        let (data_start, metadata) = header(file)?;
        let extra = metadata.metadata().clone().unwrap_or_default();
        if let Some(lrs) = extra.get("speedkit.lr") {
            self.lrs = serde_json::from_str(lrs).map_err(|e| corrupt(file, e))?;
        }
        for (key, info) in metadata.tensors() {
            let placement: serde_json::Value = extra
                .get(&key)
                .ok_or_else(|| corrupt(file, format!("no placement for {key}")))
                .and_then(|p| serde_json::from_str(p).map_err(|e| corrupt(file, e)))?;
            let offset = placement["offset"]
                .as_i64()
                .ok_or_else(|| corrupt(file, "offset"))?;
            let shape = placement["shape"]
                .as_array()
                .and_then(|s| {
                    s.iter()
                        .map(serde_json::Value::as_i64)
                        .collect::<Option<Vec<i64>>>()
                })
                .ok_or_else(|| corrupt(file, "shape"))?;
            self.stored.entry(key).or_default().push(Stored {
                file: file.to_path_buf(),
                at: data_start + info.data_offsets.0 as u64,
                dtype: info.dtype,
                offset,
                len: info.shape.iter().product::<usize>() as i64,
                shape,
            });
        }
        Ok(())
    }

    /// The model's variables and the checkpoint's are the same names with the same shapes.
    fn check_variables(&self, vs: &VarStore, dir: &Path) -> Result<()> {
        let model = variables(vs);
        for (name, var) in &model {
            let key = format!("{PARAM}/{name}");
            let stored = self.stored.get(&key).ok_or_else(|| lacks(&key, dir))?;
            if stored[0].shape != var.size() {
                return Err(SpeedkitError::Misuse(format!(
                    "{}: `{name}` is {:?} in the checkpoint and {:?} in the model",
                    dir.display(),
                    stored[0].shape,
                    var.size()
                )));
            }
        }
        let prefix = format!("{PARAM}/");
        let unknown: Vec<&str> = self
            .stored
            .keys()
            .filter_map(|k| k.strip_prefix(&prefix))
            .filter(|n| !model.iter().any(|(name, _)| name == n))
            .collect();
        if !unknown.is_empty() {
            return Err(SpeedkitError::Misuse(format!(
                "{} holds variables the model does not have: {}",
                dir.display(),
                unknown.join(", ")
            )));
        }
        Ok(())
    }

    /// Every trainable variable has AdamW's state in the checkpoint (checked before anything is
    /// read, so that a checkpoint saved without the optimizer changes nothing).
    fn check_optimizer_state(&self, vs: &VarStore, dir: &Path) -> Result<()> {
        for (name, var) in variables(vs) {
            if !var.requires_grad() {
                continue;
            }
            for kind in STATE {
                let key = format!("{kind}/{name}");
                if !self.stored.contains_key(&key) {
                    return Err(lacks(&key, dir));
                }
            }
        }
        Ok(())
    }

    /// Copies into `into` (a flat stretch of `key`'s variable, starting at element `offset`) every
    /// stored stretch of `key` that overlaps it; all of it must be covered.
    fn fill(&self, key: &str, offset: i64, into: &Tensor) -> Result<()> {
        let (begin, end) = (offset, offset + into.numel() as i64);
        let mut covered = 0;
        for stored in self.stored.get(key).into_iter().flatten() {
            let (from, to) = (
                begin.max(stored.offset),
                end.min(stored.offset + stored.len),
            );
            if from >= to {
                continue;
            }
            let values = read(stored, from - stored.offset, to - from)?;
            into.f_narrow(0, from - begin, to - from)?
                .f_copy_(&values)?;
            covered += to - from;
        }
        if covered != end - begin {
            return Err(SpeedkitError::Misuse(format!(
                "the checkpoint holds {covered} of elements {begin}..{end} of `{key}`: a rank's file is missing or from another checkpoint"
            )));
        }
        Ok(())
    }
}

/// Where a file's data starts, and its header.
fn header(file: &Path) -> Result<(u64, Metadata)> {
    let io = |source| SpeedkitError::Io {
        path: file.to_path_buf(),
        source,
    };
    let mut f = File::open(file).map_err(io)?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(io)?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return Err(corrupt(file, format!("a header of {len} bytes")));
    }
    let mut text = vec![0u8; len as usize];
    f.read_exact(&mut text).map_err(io)?;
    let metadata: Metadata = serde_json::from_slice(&text).map_err(|e| corrupt(file, e))?;
    Ok((8 + len, metadata))
}

/// Elements `skip..skip + len` of a stored stretch.
fn read(stored: &Stored, skip: i64, len: i64) -> Result<Tensor> {
    let io = |source| SpeedkitError::Io {
        path: stored.file.clone(),
        source,
    };
    let kind = kind_of(stored.dtype)?;
    let size = kind.elt_size_in_bytes() as u64;
    let mut f = File::open(&stored.file).map_err(io)?;
    f.seek(SeekFrom::Start(stored.at + skip as u64 * size))
        .map_err(io)?;
    let mut bytes = vec![0u8; (len as u64 * size) as usize];
    f.read_exact(&mut bytes).map_err(io)?;
    Ok(Tensor::f_from_data_size(&bytes, &[len], kind)?)
}

fn lacks(key: &str, dir: &Path) -> SpeedkitError {
    SpeedkitError::Misuse(format!(
        "{} has no `{key}`: not a checkpoint of this model (or saved without the optimizer)",
        dir.display()
    ))
}

fn corrupt(file: &Path, why: impl std::fmt::Display) -> SpeedkitError {
    SpeedkitError::Misuse(format!(
        "{} is not a sharded checkpoint's file: {why}",
        file.display()
    ))
}

fn dtype_of(kind: Kind) -> Result<Dtype> {
    Ok(match kind {
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Half => Dtype::F16,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        other => {
            return Err(SpeedkitError::Unsupported(format!(
                "a sharded checkpoint of {other:?} tensors"
            )))
        }
    })
}

fn kind_of(dtype: Dtype) -> Result<Kind> {
    Ok(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        other => {
            return Err(SpeedkitError::Unsupported(format!(
                "a sharded checkpoint of {other:?} tensors"
            )))
        }
    })
}
