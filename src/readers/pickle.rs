//! A restricted unpickler for the `data.pkl` of `torch.save` archives: it understands only the
//! opcodes and globals that dicts/lists/tuples of tensors and plain values use, and never
//! calls anything.
//!
//! Python's pickle is a small stack machine whose `GLOBAL` + `REDUCE` can call any importable
//! function; `torch.load(weights_only=False)` on a hostile file runs its code. Here a `GLOBAL`
//! resolves only to one of a fixed set of markers ([`Global`]); `REDUCE` on a marker runs our own
//! reconstruction (build a tensor view, make an empty dict); anything else is refused with the
//! offending global or opcode named. The whitelist was read off what torch 2.x writes
//! (`pickletools.dis` of `torch.save` output at protocols 2 and 4; see
//! `fixtures/captures/readers/gen_reader_fixtures.py`) and mirrors the spirit of torch's own
//! `weights_only` unpickler (torch/_weights_only_unpickler.py), narrowed further.
//!
//! Objects live in an arena and the stack/memo hold cheap handles, so shared references
//! (`BINGET`) cost nothing while unpickling; turning the result into a [`Value`] tree is
//! bounded in depth and in node count, which stops cycles and "billion laughs" pickles.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;

use super::tensor::{DType, HostTensor, strided_view};
use super::{Limits, ReadError};

/// A plain value decoded from a pickle.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer beyond i64 (pickle `LONG1`/`LONG4`): little-endian two's complement bytes.
    BigInt(Vec<u8>),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Value>),
    Tuple(Vec<Value>),
    /// A dict or `collections.OrderedDict`, in insertion order; keys may be any value.
    Dict(Vec<(Value, Value)>),
    Tensor(HostTensor),
}

impl Value {
    /// The value under string key `key` of a dict.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(items) => items
                .iter()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_tensor(&self) -> Option<&HostTensor> {
        match self {
            Value::Tensor(t) => Some(t),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// A short name of the variant, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::List(_) => "list",
            Value::Tuple(_) => "tuple",
            Value::Dict(_) => "dict",
            Value::Tensor(_) => "tensor",
        }
    }

    /// Whether the value holds a tensor anywhere inside it.
    pub fn contains_tensor(&self) -> bool {
        match self {
            Value::Tensor(_) => true,
            Value::List(xs) | Value::Tuple(xs) => xs.iter().any(Value::contains_tensor),
            Value::Dict(items) => items.iter().any(|(_, v)| v.contains_tensor()),
            _ => false,
        }
    }

    /// JSON rendering of a plain value: tuples become arrays, dict keys become strings,
    /// non-finite floats `null`, big ints and bytes hex strings, tensors
    /// `{"dtype", "shape"}` (no data).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Value::None => J::Null,
            Value::Bool(b) => J::Bool(*b),
            Value::Int(i) => J::from(*i),
            Value::BigInt(b) | Value::Bytes(b) => {
                J::String(b.iter().map(|x| format!("{x:02x}")).collect())
            }
            Value::Float(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
            Value::Str(s) => J::String(s.clone()),
            Value::List(xs) | Value::Tuple(xs) => J::Array(xs.iter().map(Value::to_json).collect()),
            Value::Dict(items) => J::Object(
                items
                    .iter()
                    .map(|(k, v)| (key_string(k), v.to_json()))
                    .collect(),
            ),
            Value::Tensor(t) => serde_json::json!({"dtype": t.dtype.name(), "shape": t.shape}),
        }
    }
}

/// A dict key as a string: strings as they are, other plain values in their JSON spelling.
pub fn key_string(k: &Value) -> String {
    match k {
        Value::Str(s) => s.clone(),
        other => other.to_json().to_string(),
    }
}

/// Where `BINPERSID` storages come from (the zip entries `<archive>/data/<key>`).
pub(crate) trait StorageSource {
    /// The bytes of storage `key`, which the pickle says holds `numel` elements of `dtype`.
    /// Must check that the entry holds exactly that many bytes.
    fn load(&mut self, key: &str, dtype: DType, numel: usize) -> Result<Arc<Vec<u8>>, ReadError>;
}

/// The only callables a pickle may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Global {
    /// `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, meta])`
    RebuildTensorV2,
    /// `torch._utils._rebuild_parameter(data, requires_grad, hooks)` (an `nn.Parameter`)
    RebuildParameter,
    /// `collections.OrderedDict()`
    OrderedDict,
    /// `torch.FloatStorage` and friends: only a tag inside a persistent id.
    StorageType(DType),
}

fn resolve_global(module: &str, name: &str) -> Option<Global> {
    Some(match (module, name) {
        ("torch._utils", "_rebuild_tensor_v2") => Global::RebuildTensorV2,
        ("torch._utils", "_rebuild_parameter") => Global::RebuildParameter,
        ("collections", "OrderedDict") => Global::OrderedDict,
        ("torch", storage) => Global::StorageType(match storage {
            "FloatStorage" => DType::F32,
            "HalfStorage" => DType::F16,
            "BFloat16Storage" => DType::BF16,
            "DoubleStorage" => DType::F64,
            "LongStorage" => DType::I64,
            "IntStorage" => DType::I32,
            "ShortStorage" => DType::I16,
            "CharStorage" => DType::I8,
            "ByteStorage" => DType::U8,
            "BoolStorage" => DType::Bool,
            _ => return None,
        }),
        _ => return None,
    })
}

#[derive(Debug)]
struct StorageRef {
    dtype: DType,
    key: String,
    data: Arc<Vec<u8>>,
}

/// What the stack and the memo hold: immediates, or handles to arena objects.
#[derive(Debug, Clone)]
enum Item {
    None,
    Bool(bool),
    Int(i64),
    BigInt(Rc<[u8]>),
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    Obj(usize),
    Global(Global),
    Storage(Rc<StorageRef>),
}

#[derive(Debug)]
enum Obj {
    List(Vec<Item>),
    Tuple(Vec<Item>),
    Dict(Vec<(Item, Item)>),
    Tensor(HostTensor),
}

/// Pickle opcode names, for messages (from CPython's Lib/pickletools.py).
fn opcode_name(op: u8) -> &'static str {
    match op {
        b'(' => "MARK",
        b'.' => "STOP",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'F' => "FLOAT",
        b'I' => "INT",
        b'J' => "BININT",
        b'K' => "BININT1",
        b'L' => "LONG",
        b'M' => "BININT2",
        b'N' => "NONE",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        b'R' => "REDUCE",
        b'S' => "STRING",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        b'X' => "BINUNICODE",
        b'a' => "APPEND",
        b'b' => "BUILD",
        b'c' => "GLOBAL",
        b'd' => "DICT",
        b'}' => "EMPTY_DICT",
        b'e' => "APPENDS",
        b'g' => "GET",
        b'h' => "BINGET",
        b'i' => "INST",
        b'j' => "LONG_BINGET",
        b'l' => "LIST",
        b']' => "EMPTY_LIST",
        b'o' => "OBJ",
        b'p' => "PUT",
        b'q' => "BINPUT",
        b'r' => "LONG_BINPUT",
        b's' => "SETITEM",
        b't' => "TUPLE",
        b')' => "EMPTY_TUPLE",
        b'u' => "SETITEMS",
        b'G' => "BINFLOAT",
        0x80 => "PROTO",
        0x81 => "NEWOBJ",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        0x88 => "NEWTRUE",
        0x89 => "NEWFALSE",
        0x8a => "LONG1",
        0x8b => "LONG4",
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        0x8c => "SHORT_BINUNICODE",
        0x8d => "BINUNICODE8",
        0x8e => "BINBYTES8",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x92 => "NEWOBJ_EX",
        0x93 => "STACK_GLOBAL",
        0x94 => "MEMOIZE",
        0x95 => "FRAME",
        0x96 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => "unknown opcode",
    }
}

struct Machine<'a> {
    path: &'a Path,
    data: &'a [u8],
    pos: usize,
    /// Offset of the opcode being executed, for messages.
    op_at: usize,
    stack: Vec<Item>,
    marks: Vec<usize>,
    memo: HashMap<u32, Item>,
    arena: Vec<Obj>,
    storages: HashMap<String, Rc<StorageRef>>,
    source: &'a mut dyn StorageSource,
    limits: &'a Limits,
    copy_budget: usize,
}

/// Unpickles `data` (the bytes of `data.pkl` in `path`), loading storages from `source`.
pub(crate) fn unpickle(
    path: &Path,
    data: &[u8],
    source: &mut dyn StorageSource,
    limits: &Limits,
) -> Result<Value, ReadError> {
    let mut m = Machine {
        path,
        data,
        pos: 0,
        op_at: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        arena: Vec::new(),
        storages: HashMap::new(),
        source,
        limits,
        copy_budget: limits.max_view_copy_bytes,
    };
    let top = m.run()?;
    let mut budget = Budget {
        nodes: limits.max_pickle_nodes,
        // Strings are copied out once per reference; legit pickles share few of them.
        bytes: data.len().saturating_mul(4).saturating_add(1 << 20),
    };
    m.to_value(&top, 0, &mut budget)
}

/// What converting the arena into a [`Value`] tree may still produce.
struct Budget {
    nodes: usize,
    bytes: usize,
}

impl<'a> Machine<'a> {
    fn path(&self) -> PathBuf {
        self.path.to_path_buf()
    }

    fn malformed(&self, detail: impl Into<String>) -> ReadError {
        ReadError::Pickle {
            path: self.path(),
            offset: self.op_at,
            detail: detail.into(),
        }
    }

    fn limit(&self, what: &'static str, limit: usize) -> ReadError {
        ReadError::PickleLimit {
            path: self.path(),
            what,
            limit,
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ReadError> {
        let end = self.pos.checked_add(n);
        match end.and_then(|e| self.data.get(self.pos..e)) {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => Err(self.malformed(format!(
                "{} needs {n} more bytes but the pickle ends at byte {}",
                opcode_name(self.data.get(self.op_at).copied().unwrap_or(0)),
                self.data.len()
            ))),
        }
    }

    fn u8(&mut self) -> Result<u8, ReadError> {
        Ok(self.take(1)?.first().copied().unwrap_or(0))
    }

    fn u16(&mut self) -> Result<u16, ReadError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, ReadError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, ReadError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A length prefix as usize, refused when it exceeds what is left of the pickle.
    fn len(&self, n: u64) -> Result<usize, ReadError> {
        let left = self.data.len().saturating_sub(self.pos);
        match usize::try_from(n) {
            Ok(n) if n <= left => Ok(n),
            _ => Err(self.malformed(format!(
                "length {n} runs past the end of the pickle ({left} bytes left)"
            ))),
        }
    }

    /// A text line of GLOBAL (`module\n`, `name\n`), at most 256 bytes.
    fn line(&mut self) -> Result<&'a str, ReadError> {
        let rest = self.data.get(self.pos..).unwrap_or(&[]);
        let n = rest
            .iter()
            .take(257)
            .position(|&b| b == b'\n')
            .ok_or_else(|| {
                self.malformed("GLOBAL name is not newline-terminated within 256 bytes")
            })?;
        let s = std::str::from_utf8(&rest[..n])
            .map_err(|_| self.malformed("GLOBAL name is not UTF-8"))?;
        self.pos += n + 1;
        Ok(s)
    }

    fn text(&self, b: &[u8]) -> Result<Rc<str>, ReadError> {
        std::str::from_utf8(b)
            .map(Rc::from)
            .map_err(|_| self.malformed("string is not valid UTF-8"))
    }

    fn push(&mut self, it: Item) -> Result<(), ReadError> {
        if self.stack.len() >= self.limits.max_pickle_stack {
            return Err(self.limit("stack items", self.limits.max_pickle_stack));
        }
        self.stack.push(it);
        Ok(())
    }

    fn pop(&mut self) -> Result<Item, ReadError> {
        match self.stack.pop() {
            Some(it) => {
                // Popping below a mark invalidates it.
                if self.marks.last().is_some_and(|&m| m > self.stack.len()) {
                    return Err(self.malformed("stack popped below a MARK"));
                }
                Ok(it)
            }
            None => Err(self.malformed(format!(
                "{} on an empty stack",
                opcode_name(self.data.get(self.op_at).copied().unwrap_or(0))
            ))),
        }
    }

    fn top(&self) -> Result<&Item, ReadError> {
        self.stack
            .last()
            .ok_or_else(|| self.malformed("MEMOIZE/PUT on an empty stack"))
    }

    fn pop_mark(&mut self) -> Result<Vec<Item>, ReadError> {
        let m = self
            .marks
            .pop()
            .ok_or_else(|| self.malformed("no MARK on the stack"))?;
        if m > self.stack.len() {
            return Err(self.malformed("MARK lies above the stack top"));
        }
        Ok(self.stack.split_off(m))
    }

    fn alloc(&mut self, o: Obj) -> Result<Item, ReadError> {
        if self.arena.len() >= self.limits.max_pickle_objects {
            return Err(self.limit("objects", self.limits.max_pickle_objects));
        }
        self.arena.push(o);
        Ok(Item::Obj(self.arena.len() - 1))
    }

    fn memo_put(&mut self, idx: u32) -> Result<(), ReadError> {
        let it = self.top()?.clone();
        if !self.memo.contains_key(&idx) && self.memo.len() >= self.limits.max_pickle_memo {
            return Err(self.limit("memo entries", self.limits.max_pickle_memo));
        }
        self.memo.insert(idx, it);
        Ok(())
    }

    fn memo_get(&mut self, idx: u32) -> Result<(), ReadError> {
        let it = self.memo.get(&idx).cloned().ok_or_else(|| {
            self.malformed(format!("memo entry {idx} read before it was written"))
        })?;
        self.push(it)
    }

    fn global(&mut self, module: &str, name: &str) -> Result<(), ReadError> {
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3") {
            return Err(ReadError::UnsupportedDtype {
                path: self.path(),
                what: "tensor".into(),
                dtype: "one torch saves with _rebuild_tensor_v3 (float8, uint16/32/64, complex32, bits)"
                    .into(),
            });
        }
        match resolve_global(module, name) {
            Some(g) => self.push(Item::Global(g)),
            None => Err(ReadError::PickleGlobal {
                path: self.path(),
                global: format!("{module}.{name}"),
                offset: self.op_at,
            }),
        }
    }

    fn forbidden(&self, op: u8) -> ReadError {
        ReadError::PickleOpcode {
            path: self.path(),
            opcode: format!("{} (0x{op:02x})", opcode_name(op)),
            offset: self.op_at,
        }
    }

    fn obj_mut(&mut self, it: &Item) -> Result<&mut Obj, ReadError> {
        let idx = match it {
            Item::Obj(i) => *i,
            other => {
                return Err(
                    self.malformed(format!("expected a container, found {}", item_kind(other)))
                );
            }
        };
        let e = self.malformed("dangling object handle");
        self.arena.get_mut(idx).ok_or(e)
    }

    fn tuple_items(&self, it: &Item) -> Result<Vec<Item>, ReadError> {
        match it {
            Item::Obj(i) => match self.arena.get(*i) {
                Some(Obj::Tuple(xs)) => Ok(xs.clone()),
                _ => Err(self.malformed("expected a tuple")),
            },
            other => Err(self.malformed(format!("expected a tuple, found {}", item_kind(other)))),
        }
    }

    fn run(&mut self) -> Result<Item, ReadError> {
        loop {
            self.op_at = self.pos;
            let op = match self.data.get(self.pos) {
                Some(&b) => b,
                None => return Err(self.malformed("pickle ends without STOP")),
            };
            self.pos += 1;
            match op {
                0x80 => {
                    let v = self.u8()?;
                    if v > 5 {
                        return Err(self.malformed(format!("unknown pickle protocol {v}")));
                    }
                }
                0x95 => {
                    // FRAME: a length hint for buffered readers; the data follows inline.
                    let n = self.u64()?;
                    self.len(n)?;
                }
                b'.' => return self.pop(),
                b'(' => {
                    if self.marks.len() >= self.limits.max_pickle_stack {
                        return Err(self.limit("marks", self.limits.max_pickle_stack));
                    }
                    self.marks.push(self.stack.len());
                }
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let it = self.top()?.clone();
                    self.push(it)?;
                }
                b'}' => {
                    let it = self.alloc(Obj::Dict(Vec::new()))?;
                    self.push(it)?;
                }
                b']' => {
                    let it = self.alloc(Obj::List(Vec::new()))?;
                    self.push(it)?;
                }
                b')' => {
                    let it = self.alloc(Obj::Tuple(Vec::new()))?;
                    self.push(it)?;
                }
                b'N' => self.push(Item::None)?,
                0x88 => self.push(Item::Bool(true))?,
                0x89 => self.push(Item::Bool(false))?,
                b'J' => {
                    let v = self.u32()? as i32;
                    self.push(Item::Int(i64::from(v)))?;
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push(Item::Int(i64::from(v)))?;
                }
                b'M' => {
                    let v = self.u16()?;
                    self.push(Item::Int(i64::from(v)))?;
                }
                0x8a | 0x8b => {
                    let n = if op == 0x8a {
                        u64::from(self.u8()?)
                    } else {
                        u64::from(self.u32()?)
                    };
                    let n = self.len(n)?;
                    let b = self.take(n)?;
                    self.push(long_item(b))?;
                }
                b'G' => {
                    let b = self.take(8)?;
                    let mut a = [0u8; 8];
                    a.copy_from_slice(b);
                    self.push(Item::Float(f64::from_be_bytes(a)))?;
                }
                b'X' | 0x8c | 0x8d => {
                    let n = match op {
                        b'X' => u64::from(self.u32()?),
                        0x8c => u64::from(self.u8()?),
                        _ => self.u64()?,
                    };
                    let n = self.len(n)?;
                    let b = self.take(n)?;
                    let s = self.text(b)?;
                    self.push(Item::Str(s))?;
                }
                b'B' | b'C' | 0x8e => {
                    let n = match op {
                        b'B' => u64::from(self.u32()?),
                        b'C' => u64::from(self.u8()?),
                        _ => self.u64()?,
                    };
                    let n = self.len(n)?;
                    let b = self.take(n)?;
                    self.push(Item::Bytes(Rc::from(b)))?;
                }
                b't' => {
                    let xs = self.pop_mark()?;
                    let it = self.alloc(Obj::Tuple(xs))?;
                    self.push(it)?;
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    if self.stack.len() < n {
                        return Err(
                            self.malformed(format!("TUPLE{n} on a stack of {}", self.stack.len()))
                        );
                    }
                    let mut xs = Vec::with_capacity(n);
                    for _ in 0..n {
                        xs.push(self.pop()?);
                    }
                    xs.reverse();
                    let it = self.alloc(Obj::Tuple(xs))?;
                    self.push(it)?;
                }
                b'a' => {
                    let v = self.pop()?;
                    let list = self.top()?.clone();
                    match self.obj_mut(&list)? {
                        Obj::List(xs) => xs.push(v),
                        _ => return Err(self.malformed("APPEND to something that is not a list")),
                    }
                }
                b'e' => {
                    let vs = self.pop_mark()?;
                    let list = self.top()?.clone();
                    match self.obj_mut(&list)? {
                        Obj::List(xs) => xs.extend(vs),
                        _ => return Err(self.malformed("APPENDS to something that is not a list")),
                    }
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    let d = self.top()?.clone();
                    self.set_items(&d, vec![k, v])?;
                }
                b'u' => {
                    let kvs = self.pop_mark()?;
                    if !kvs.len().is_multiple_of(2) {
                        return Err(self.malformed("SETITEMS with an odd number of items"));
                    }
                    let d = self.top()?.clone();
                    self.set_items(&d, kvs)?;
                }
                b'q' => {
                    let i = self.u8()?;
                    self.memo_put(u32::from(i))?;
                }
                b'r' => {
                    let i = self.u32()?;
                    self.memo_put(i)?;
                }
                0x94 => {
                    let i = u32::try_from(self.memo.len())
                        .map_err(|_| self.limit("memo entries", self.limits.max_pickle_memo))?;
                    self.memo_put(i)?;
                }
                b'h' => {
                    let i = self.u8()?;
                    self.memo_get(u32::from(i))?;
                }
                b'j' => {
                    let i = self.u32()?;
                    self.memo_get(i)?;
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    self.global(module, name)?;
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (module, name) {
                        (Item::Str(m), Item::Str(n)) => self.global(&m, &n)?,
                        _ => return Err(self.malformed("STACK_GLOBAL needs two strings")),
                    }
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let st = self.persistent_load(&pid)?;
                    self.push(Item::Storage(st))?;
                }
                b'R' => {
                    let args = self.pop()?;
                    let func = self.pop()?;
                    let out = self.reduce(&func, &args)?;
                    self.push(out)?;
                }
                b'b' => {
                    let state = self.pop()?;
                    let target = self.top()?.clone();
                    self.build(&target, &state)?;
                }
                _ => return Err(self.forbidden(op)),
            }
        }
    }

    fn set_items(&mut self, d: &Item, kvs: Vec<Item>) -> Result<(), ReadError> {
        let mut it = kvs.into_iter();
        let mut pairs = Vec::new();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            pairs.push((k, v));
        }
        match self.obj_mut(d)? {
            Obj::Dict(items) => {
                for (k, v) in pairs {
                    // Python semantics: a repeated key replaces the value in place.
                    match items.iter_mut().find(|(old, _)| same_key(old, &k)) {
                        Some(slot) => slot.1 = v,
                        None => items.push((k, v)),
                    }
                }
                Ok(())
            }
            _ => Err(self.malformed("SETITEM(S) on something that is not a dict")),
        }
    }

    /// `BINPERSID` with torch's id `('storage', StorageType, key, location, numel)`.
    fn persistent_load(&mut self, pid: &Item) -> Result<Rc<StorageRef>, ReadError> {
        let xs = self.tuple_items(pid)?;
        let (dtype, key, numel) = match xs.as_slice() {
            [
                Item::Str(tag),
                Item::Global(Global::StorageType(dt)),
                Item::Str(key),
                Item::Str(_loc),
                Item::Int(n),
            ] if &**tag == "storage" => {
                let n = usize::try_from(*n)
                    .map_err(|_| self.malformed(format!("storage {key} has {n} elements")))?;
                (*dt, key.to_string(), n)
            }
            _ => {
                return Err(self.malformed(
                    "persistent id is not ('storage', torch.<Type>Storage, key, location, numel)",
                ));
            }
        };
        if let Some(st) = self.storages.get(&key) {
            if st.dtype != dtype || st.data.len() != numel.saturating_mul(dtype.size()) {
                return Err(self.malformed(format!(
                    "storage {key} is referenced as {} x{numel} and as {} x{}",
                    dtype,
                    st.dtype,
                    st.data.len() / st.dtype.size()
                )));
            }
            return Ok(Rc::clone(st));
        }
        let data = self.source.load(&key, dtype, numel)?;
        let st = Rc::new(StorageRef {
            dtype,
            key: key.clone(),
            data,
        });
        self.storages.insert(key, Rc::clone(&st));
        Ok(st)
    }

    fn reduce(&mut self, func: &Item, args: &Item) -> Result<Item, ReadError> {
        let g = match func {
            Item::Global(g) => *g,
            other => {
                return Err(self.malformed(format!(
                    "REDUCE calls a {}, not a whitelisted global",
                    item_kind(other)
                )));
            }
        };
        let args = self.tuple_items(args)?;
        match g {
            Global::OrderedDict => {
                if !args.is_empty() {
                    return Err(self.malformed("collections.OrderedDict called with arguments"));
                }
                self.alloc(Obj::Dict(Vec::new()))
            }
            Global::RebuildTensorV2 => {
                let t = self.rebuild_tensor(&args)?;
                self.alloc(Obj::Tensor(t))
            }
            Global::RebuildParameter => match args.as_slice() {
                [t @ Item::Obj(i), Item::Bool(_), Item::Obj(_)]
                    if matches!(self.arena.get(*i), Some(Obj::Tensor(_))) =>
                {
                    Ok(t.clone())
                }
                _ => Err(self.malformed(
                    "torch._utils._rebuild_parameter needs (tensor, requires_grad, hooks)",
                )),
            },
            Global::StorageType(dt) => Err(self.malformed(format!(
                "the {dt} storage type is called directly (it may only tag a persistent id)"
            ))),
        }
    }

    fn rebuild_tensor(&mut self, args: &[Item]) -> Result<HostTensor, ReadError> {
        let (st, offset, size, stride, hooks) = match args {
            [
                Item::Storage(st),
                Item::Int(off),
                size,
                stride,
                Item::Bool(_),
                hooks,
            ]
            | [
                Item::Storage(st),
                Item::Int(off),
                size,
                stride,
                Item::Bool(_),
                hooks,
                _,
            ] => (Rc::clone(st), *off, size, stride, hooks),
            _ => {
                return Err(self.malformed(
                    "torch._utils._rebuild_tensor_v2 needs (storage, offset, size, stride, requires_grad, hooks)",
                ));
            }
        };
        // The hooks slot must be the empty OrderedDict torch writes: nothing callable.
        match hooks {
            Item::Obj(i) if matches!(self.arena.get(*i), Some(Obj::Dict(d)) if d.is_empty()) => {}
            Item::None => {}
            _ => return Err(self.malformed("tensor backward_hooks is not an empty OrderedDict")),
        }
        let offset = usize::try_from(offset)
            .map_err(|_| self.malformed(format!("negative storage offset {offset}")))?;
        let size: Vec<usize> = self
            .tuple_items(size)?
            .iter()
            .map(|x| match x {
                Item::Int(v) => usize::try_from(*v).ok(),
                _ => None,
            })
            .collect::<Option<_>>()
            .ok_or_else(|| self.malformed("tensor size is not a tuple of non-negative ints"))?;
        let stride: Vec<i64> = self
            .tuple_items(stride)?
            .iter()
            .map(|x| match x {
                Item::Int(v) => Some(*v),
                _ => None,
            })
            .collect::<Option<_>>()
            .ok_or_else(|| self.malformed("tensor stride is not a tuple of ints"))?;
        strided_view(
            st.dtype,
            &st.data,
            offset,
            &size,
            &stride,
            &mut self.copy_budget,
        )
        .map_err(|error| ReadError::Tensor {
            path: self.path(),
            what: format!("tensor on storage {}", st.key),
            error,
        })
    }

    /// `BUILD` is accepted only as a no-op (state None or an empty dict/tuple).
    fn build(&mut self, target: &Item, state: &Item) -> Result<(), ReadError> {
        let empty = match state {
            Item::None => true,
            Item::Obj(i) => match self.arena.get(*i) {
                Some(Obj::Dict(d)) => d.is_empty(),
                Some(Obj::Tuple(t)) => t.is_empty(),
                _ => false,
            },
            _ => false,
        };
        if empty && matches!(target, Item::Obj(_)) {
            Ok(())
        } else {
            Err(self.malformed("BUILD with a non-empty state (object state is not restored)"))
        }
    }

    fn to_value(&self, it: &Item, depth: usize, budget: &mut Budget) -> Result<Value, ReadError> {
        budget.nodes = budget.nodes.checked_sub(1).ok_or_else(|| {
            self.limit(
                "values after expanding shared references",
                self.limits.max_pickle_nodes,
            )
        })?;
        let len = match it {
            Item::Str(s) => s.len(),
            Item::Bytes(b) | Item::BigInt(b) => b.len(),
            _ => 0,
        };
        budget.bytes = budget.bytes.checked_sub(len).ok_or_else(|| {
            self.limit(
                "bytes of strings after expanding shared references",
                self.data.len().saturating_mul(4).saturating_add(1 << 20),
            )
        })?;
        if depth > self.limits.max_pickle_depth {
            return Err(self.limit("levels of nesting", self.limits.max_pickle_depth));
        }
        Ok(match it {
            Item::None => Value::None,
            Item::Bool(b) => Value::Bool(*b),
            Item::Int(i) => Value::Int(*i),
            Item::BigInt(b) => Value::BigInt(b.to_vec()),
            Item::Float(f) => Value::Float(*f),
            Item::Str(s) => Value::Str(s.to_string()),
            Item::Bytes(b) => Value::Bytes(b.to_vec()),
            Item::Global(g) => {
                return Err(ReadError::Pickle {
                    path: self.path(),
                    offset: self.op_at,
                    detail: format!("result holds a bare global {g:?} instead of a value"),
                });
            }
            Item::Storage(st) => {
                return Err(ReadError::Pickle {
                    path: self.path(),
                    offset: self.op_at,
                    detail: format!("result holds a bare storage {} instead of a tensor", st.key),
                });
            }
            Item::Obj(i) => match self.arena.get(*i) {
                Some(Obj::List(xs)) => Value::List(self.values(xs, depth, budget)?),
                Some(Obj::Tuple(xs)) => Value::Tuple(self.values(xs, depth, budget)?),
                Some(Obj::Dict(items)) => {
                    let mut out = Vec::with_capacity(items.len());
                    for (k, v) in items {
                        out.push((
                            self.to_value(k, depth + 1, budget)?,
                            self.to_value(v, depth + 1, budget)?,
                        ));
                    }
                    Value::Dict(out)
                }
                Some(Obj::Tensor(t)) => Value::Tensor(t.clone()),
                None => return Err(self.malformed("dangling object handle")),
            },
        })
    }

    fn values(
        &self,
        xs: &[Item],
        depth: usize,
        budget: &mut Budget,
    ) -> Result<Vec<Value>, ReadError> {
        xs.iter()
            .map(|x| self.to_value(x, depth + 1, budget))
            .collect()
    }
}

fn item_kind(it: &Item) -> &'static str {
    match it {
        Item::None => "None",
        Item::Bool(_) => "bool",
        Item::Int(_) | Item::BigInt(_) => "int",
        Item::Float(_) => "float",
        Item::Str(_) => "str",
        Item::Bytes(_) => "bytes",
        Item::Obj(_) => "container",
        Item::Global(_) => "global",
        Item::Storage(_) => "storage",
    }
}

/// Dict keys compare by value for immediates (what real dicts use), by identity otherwise.
fn same_key(a: &Item, b: &Item) -> bool {
    match (a, b) {
        (Item::Str(x), Item::Str(y)) => x == y,
        (Item::Int(x), Item::Int(y)) => x == y,
        (Item::Bool(x), Item::Bool(y)) => x == y,
        (Item::None, Item::None) => true,
        (Item::Obj(x), Item::Obj(y)) => x == y,
        _ => false,
    }
}

/// `LONG1`/`LONG4` payload: little-endian two's complement of any length.
fn long_item(b: &[u8]) -> Item {
    if b.is_empty() {
        return Item::Int(0);
    }
    if b.len() <= 8 {
        let neg = b.last().is_some_and(|&x| x & 0x80 != 0);
        let mut a = [if neg { 0xff } else { 0 }; 8];
        a[..b.len()].copy_from_slice(b);
        return Item::Int(i64::from_le_bytes(a));
    }
    Item::BigInt(Rc::from(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct NoStorage;
    impl StorageSource for NoStorage {
        fn load(&mut self, key: &str, _: DType, _: usize) -> Result<Arc<Vec<u8>>, ReadError> {
            Err(ReadError::Format {
                path: PathBuf::from("mem"),
                detail: format!("no storage {key}"),
            })
        }
    }

    fn run(bytes: &[u8]) -> Result<Value, ReadError> {
        unpickle(
            Path::new("mem.pkl"),
            bytes,
            &mut NoStorage,
            &Limits::default(),
        )
    }

    #[test]
    fn plain_values_protocol_2() {
        // pickle.dumps({'a': [1, -5, 1.5, None, True], 'b': (2**70, 'x')}, protocol=2)
        let mut p = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01J\xfb\xff\xff\xffG?\xf8\x00\x00\x00\x00\x00\x00N\x88eX\x01\x00\x00\x00bq\x03\x8a\t".to_vec();
        p.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0x40]);
        p.extend_from_slice(b"X\x01\x00\x00\x00xq\x04\x86q\x05u.");
        let v = run(&p).unwrap();
        assert_eq!(
            v.get("a").unwrap(),
            &Value::List(vec![
                Value::Int(1),
                Value::Int(-5),
                Value::Float(1.5),
                Value::None,
                Value::Bool(true)
            ])
        );
        assert_eq!(
            v.get("b").unwrap(),
            &Value::Tuple(vec![
                Value::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0, 0x40]),
                Value::Str("x".into())
            ])
        );
    }

    #[test]
    fn long1_small_values() {
        assert!(matches!(long_item(&[0xff]), Item::Int(-1)));
        assert!(matches!(long_item(&[0x00, 0x01]), Item::Int(256)));
        assert!(matches!(long_item(&[]), Item::Int(0)));
    }

    #[test]
    fn refuses_unknown_global_before_any_call() {
        let e = run(b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R.").unwrap_err();
        assert_eq!(
            e.to_string(),
            "mem.pkl: pickle global os.system (at byte 2) is not allowed (only tensor-dict globals are)"
        );
    }

    #[test]
    fn refuses_reduce_on_a_plain_value() {
        let e = run(b"\x80\x02X\x01\x00\x00\x00a)R.").unwrap_err();
        assert!(e.to_string().contains("REDUCE calls a str"), "{e}");
    }

    #[test]
    fn truncated_and_garbage_inputs_error_without_panicking() {
        let good = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01K\x02eu.";
        for n in 0..good.len() {
            assert!(run(&good[..n]).is_err(), "prefix {n} should fail");
        }
        assert!(run(good).is_ok());
        // Every single-byte corruption: must return (Ok or Err), never panic.
        for i in 0..good.len() {
            for b in [0u8, 0x28, 0x2e, 0x71, 0x68, 0x75, 0x80, 0xff] {
                let mut p = good.to_vec();
                p[i] = b;
                let _ = run(&p);
            }
        }
    }

    #[test]
    fn pop_below_mark_is_malformed() {
        let e = run(b"\x80\x02K\x01(0t.").unwrap_err();
        assert!(e.to_string().contains("below a MARK"), "{e}");
    }
}
