//! The shell around a plan's engine commands: POSIX `sh` (dash on Debian and Ubuntu) with
//! `set -eu`; helpers that start, wait for and stop a server by its PID; and the prompt sender.
//! `tests/plan.rs` runs every printed script under dash against a stub engine
//! (fixtures/engines/stub_engine.py).

use crate::engine::Engine;

/// A value for a shell command line, single-quoted when it needs to be.
pub fn sh(value: &str) -> String {
    if !value.is_empty()
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-=:@+,".contains(c))
    {
        value.to_string()
    } else {
        format!("'{}'", value.replace('\'', r"'\''"))
    }
}

/// The engine's HTTP port, and the time-outs, as the script's first lines (each can be set in
/// the environment, which is how the test points the script at its stub server).
pub fn settings(engine: Engine) -> Vec<String> {
    // Default ports: sglang srt/arg_groups/fields/serving.py (`port ... = 30000`), vLLM
    // entrypoints/common/cli_args.py FrontendArgs (`port: int = 8000`).
    let port = if engine == Engine::Sglang {
        30000
    } else {
        8000
    };
    vec![
        format!("PORT=${{EAGLE_CHECK_PORT:-{port}}}"),
        // A 671B checkpoint over a network file system takes tens of minutes to load.
        "READY_TIMEOUT=${EAGLE_CHECK_READY_TIMEOUT:-3600}".into(),
        "SETTLE_TIMEOUT=${EAGLE_CHECK_SETTLE_TIMEOUT:-600}".into(),
        "SERVER_PID=".into(),
    ]
}

/// A script variable whose value plan knows, or one the user must set (the script stops at its
/// first line with `message` when it is not set).
pub fn variable(name: &str, value: Option<&str>, message: &str) -> String {
    match value {
        Some(v) => format!("{name}={}", sh(v)),
        None => format!("{name}=${{EAGLE_CHECK_{name}:?{message}}}"),
    }
}

/// The helpers every plan's commands call.
pub const HELPERS: &str = r#"# Stops the server started last, by its PID, and waits until it has exited: the next server
# needs its port and its GPUs. Runs on every exit of this script too.
stop_server() {
  if [ -n "$SERVER_PID" ]; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=
  fi
}
trap stop_server EXIT
trap 'exit 130' INT TERM

# fresh_dir DIR: makes DIR, and refuses one that holds files already (the dumps of an earlier
# run would be read as sequences of this one).
fresh_dir() {
  mkdir -p "$1"
  if [ -n "$(ls -A "$1")" ]; then
    echo "eagle-check plan: $1 is not empty (dumps of an earlier run?); move it away first" >&2
    exit 1
  fi
}

# wait_ready URL LOG: waits until the server answers URL with 200; stops with the end of LOG
# when the server exits first, and after READY_TIMEOUT seconds.
wait_ready() {
  waited=0
  until python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)' "$1" 2>/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      status=0
      wait "$SERVER_PID" || status=$?
      SERVER_PID=
      echo "eagle-check plan: the server exited (status $status) before $1 answered; the end of $2:" >&2
      tail -n 20 "$2" >&2
      exit 1
    fi
    if [ "$waited" -ge "$READY_TIMEOUT" ]; then
      echo "eagle-check plan: $1 did not answer within $READY_TIMEOUT s (EAGLE_CHECK_READY_TIMEOUT); stopping the server (its log: $2)" >&2
      exit 1
    fi
    sleep 1
    waited=$((waited + 1))
  done
}
"#;

/// vLLM only: its connector writes each file from a thread pool after the response.
pub const WAIT_FILES: &str = r#"# wait_files DIR N: waits until DIR holds N .safetensors files whose sizes have stopped
# changing, for SETTLE_TIMEOUT seconds at most (vLLM writes each file from a thread pool after
# the response; a server stopped before that leaves it short or missing).
wait_files() {
  waited=0
  seen=
  while :; do
    now=$(ls -ln "$1" | awk '/\.safetensors$/ { n += 1; s += $5 } END { print n + 0, s + 0 }')
    if [ "${now%% *}" -ge "$2" ] && [ "$now" = "$seen" ]; then
      return 0
    fi
    if [ "$waited" -ge "$SETTLE_TIMEOUT" ]; then
      echo "eagle-check plan: $1 holds ${now%% *} of $2 dump files after $SETTLE_TIMEOUT s (EAGLE_CHECK_SETTLE_TIMEOUT)" >&2
      exit 1
    fi
    seen=$now
    sleep 1
    waited=$((waited + 1))
  done
}
"#;

/// The non-empty lines of the prompts file: the number of requests, and of vLLM's files.
pub const PROMPT_COUNT: &str = r#""$(grep -c '[^[:space:]]' "$PROMPTS")""#;

/// A server's launch line, in the background with its output in `log`, then its PID kept and
/// its health route waited for.
pub fn start(launch: String, log: &str, health: &str) -> Vec<String> {
    vec![
        format!("{launch} \\\n  >{} 2>&1 &", sh(log)),
        "SERVER_PID=$!".into(),
        format!("wait_ready \"http://127.0.0.1:$PORT{health}\" {}", sh(log)),
    ]
}

/// The prompt sender: stdlib Python, one request at a time, one new token each (the dumps are
/// of the prefill; a decode step is not a whole sequence). `python3 send_prompts.py URL PROMPTS
/// [MODEL]`; exits with the engine's answer when a request is refused.
pub fn sender(engine: Engine) -> String {
    // sglang: POST /generate (srt/entrypoints/http_server.py) with `text` or `input_ids` and
    // `sampling_params` (srt/managers/io_struct.py GenerateReqInput; max_new_tokens,
    // temperature: srt/sampling/sampling_params.py). vLLM: POST /v1/completions
    // (entrypoints/openai/completion/api_router.py), `model`, `prompt` (text or token ids),
    // `max_tokens`, `temperature` (entrypoints/openai/completion/protocol.py
    // CompletionRequest).
    let (body, after) = match engine {
        Engine::Sglang => (
            r#"dict(req, sampling_params={"max_new_tokens": 1, "temperature": 0})"#,
            "",
        ),
        _ => (
            r#"{"model": sys.argv[3], "prompt": req.get("text", req.get("input_ids")), "max_tokens": 1, "temperature": 0}"#,
            // example_hidden_states_connector.py: the response's kv_transfer_params name the
            // file (request_finished), written from a thread pool while an exclusive flock on
            // FILE.lock is held (_write_tensors); load_hidden_states waits with a shared one.
            "    # vLLM writes the file after answering, holding an exclusive lock on FILE.lock until\n\
             \x20   # it is written (example_hidden_states_connector.py load_hidden_states): wait the same way.\n\
             \x20   path = (reply.get(\"kv_transfer_params\") or {}).get(\"hidden_states_path\")\n\
             \x20   if path and os.path.exists(path + \".lock\"):\n\
             \x20       with open(path + \".lock\") as lock:\n\
             \x20           fcntl.flock(lock, fcntl.LOCK_SH)\n",
        ),
    };
    format!(
        "# Posts each line of a prompts JSONL ({{\"text\": ...}} or {{\"input_ids\": [...]}}) to the engine, one at a time.\n\
             # python3 send_prompts.py URL PROMPTS [MODEL]\n\
             import fcntl, json, os, sys, urllib.error, urllib.request\n\
             for n, line in enumerate(open(sys.argv[2]), 1):\n\
             \x20   if not line.strip():\n\
             \x20       continue\n\
             \x20   req = json.loads(line)\n\
             \x20   body = json.dumps({body}).encode()\n\
             \x20   r = urllib.request.Request(sys.argv[1], data=body, headers={{\"Content-Type\": \"application/json\"}})\n\
             \x20   try:\n\
             \x20       reply = json.loads(urllib.request.urlopen(r).read())\n\
             \x20   except urllib.error.HTTPError as e:\n\
             \x20       sys.exit(f\"eagle-check plan: {{sys.argv[2]}}:{{n}}: the engine answered {{e.code}}: {{e.read().decode(errors='replace')}}\")\n\
             {after}"
    )
}
