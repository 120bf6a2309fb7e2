"""The mint rule: compile ONE key's AOTInductor package, prove it, and seal it.

`python -m cgbuild_rules.mint` reads one JSON request on stdin and writes one JSON result line
on stdout (torch's own prints go to stderr). The worker itself never imports torch: it runs two
stage children and seals what they produced, so a segfault, an OOM kill or a hang in torch is a
typed failure of a stage, never a lost result. It talks to them as the engine talks to it
(`cgbuild.protocol.stage`, docs/architecture.md): a `StageStart` line (the job, the stage's
`StageEnv`, the key's `MintRequest` unless a hold started it), a `Go` line per part once its
input exists, one typed answer per part back (`Traced`, `Compiled`, `Verified`, `Measured`,
`Served`; a line that is none is `mint-error` naming the field) or a `MintFailed` with its
phase; the worker blocks on the answer, the child's end or the part's deadline.

1. `compile` stage, in a scrubbed, declared environment (`cgbuild.identity.policy`) with the chosen host
   compiler as `CXX` and the temp and Inductor cache folders inside a sandbox at a FIXED path:
   (a) refuses a key whose device this machine does not have (`wrong-device`, naming the sm);
   (b) traces the job (trace rule, mode `empty`) and reports its graph facts (`trace.json`);
   (c) on the worker's go, re-derives the toolchain (`cgbuild.identity.toolchain.probe`) and
   refuses `toolchain-drift` / `graph-drift` (old → new) when it or the traced digest differs
   from the key it was asked to build, so a drifted worker image never seals under a wrong key;
   (d) compiles weightless under the one compile policy; (e) normalizes the package (below).
   A HOLD (`cgbuild.protocol.mint.MintHold`: the plan's trace of a unit `cgbuild mint` will
   mint, docs/architecture.md) starts the worker before any key exists: (b) runs first (fake
   when this machine lacks the device), the worker hands its `Traced` to the engine
   (`{"traced": ...}` on its protocol stream; a line that is no `Traced` is `trace-failed`) and
   reads the key's request as its next stdin line (`bad-request` unless it names the job traced
   and the folders the worker was started with, or is no JSON object); (a) and (c) follow, and
   the check stage starts only then. An empty line or the end of its input ends a hold without
   a result. The compile and verify parts get the key's request with their go.
2-5 run in ONE `check` stage child, started beside the compile: it imports torch and the entry
and builds the module with its seed-0 random weights while the compile runs (about 20 s of a
klein-4B mint that no longer waits on it), then runs each part when the worker hands it its go:
2. `verify`: loads the normalized package through the real loader, binds the module's weights by
   FQN (user-managed, never calling before binding: that segfaults), runs the entry's inputs and
   compares with eager (with the compile's literals) under a per-dtype tolerance, or the quant
   rule's own. With lanes (docs/lanes.md) it runs EVERY lane combination of the one package
   against eager with the same lane (`verify-mismatch` names the lane) and checks each value
   against its axis's reference (the numerics self-check).
3. `measure`: every candidate lane in turn (`cgbuild.lanes.candidates`: buildable and numerically
   sound; none when fewer than two): per lane 3 warm-ups, reset peak, 9 timed calls, median and
   peak (`cgbuild_rules.lanes.measure`); the worker applies the fit rule (`cgbuild.lanes.decide`)
   for the request's SKU.
4. Then the worker writes the metadata (with the discrete lane verdict) and seals
   (`cgbuild.store.seal`) into its work folder.
5. `serve`: the sealed artifact is adopted as a serving process adopts it
   (`cgbuild_rules.adopt.adopt`, strict: unsealed and loaded anew) into the entry's live module,
   the entry's call must be served compiled, and it is compared with eager; so is the entry's
   call at both ends of each declared range (docs/entry.md), its traced size being inside; a
   refusal fails the mint with adopt's own code (docs/adopt.md), a mismatch at a range's size
   with `verify-mismatch` naming it (`the call at frames=4: ...`). Only then does the artifact
   move to `<out>/<key>.tar.gz`. The child's death in a part is that phase's typed failure.

Failures are typed: `retryable` ones (`oom`, `worker-killed`, `worker-signal`, `worker-crashed`,
`timeout`: how a stage child ended, named by `cgbuild.protocol.spawn`) may succeed on another
attempt; the others (refusals, compile errors, verification mismatch) will not. Phase timings
go in the result line, never in the sealed bytes (a hold's `total` counts from its key's
request: its `export`, the trace, ran during the plan).

Request (`schema: "cgbuild.mint-request/1"`): `id`, `key`, `job` (a trace job), `sm`,
`graph_digest`, `toolchain` {`platform`, `fold`, `components`}; optional `axes` (readable blocks),
`facets`, `stamp`, `layout` {`quant`, `dtype`, `component`, `reference`, `topology`,
`quant_digest`} (re-derived here: `layout-drift` when it moved; sealed as the tensor table adopt
checks), `lanes` {`axes`: [[axis, declared values]] in declaration order, `needs`: {axis: {value:
needs}}, `sku`: {`name`, `memory_bytes`} the verdict is fitted to}, `labels`, `cxx` (compiler
override), `out` (folder for `<key>.tar.gz`),
`sandbox` (default `DEFAULT_SANDBOX`), `empty_sandbox` (empty the sandbox first, under an exclusive lock),
`compare_with` (an earlier artifact of the key: the result adds `seal.compare_artifacts`'s
`reproducible`, `differing` members, metadata `fields` and `verdict_moved`),
`timeout_s` (per stage part: the trace, the compile, each check).
Result: `{"id", "ok": true, "key", "artifact", "sha256", "size", "members": {name: sha256},
"verify": [{"output", "dtype", "rel_rms", "tolerance", "max_abs", "lane"?}] (from the serve stage),
"served": [{"lane"?, "counters", "seconds"}], "device": {"type", "visible" (the
`CUDA_VISIBLE_DEVICES` the mint ran under), "index"?, "name"?, "uuid"? (on a GPU)} (the device
verify ran on: a machine fact, never sealed), "phases": {"wait"? (for the compile sandbox),
"export", "compile", "verify", "lanes"?, "seal", "serve", "total"}, "lane_evidence"?: {raw
timings, samples, peaks, device, numerics, verdict}}` (the
engine files the evidence beside the artifact, never in it) or `{"id", "ok": false, "code",
"retryable", "phase", "detail", ...}` with `old`/`new`
(drift), `changes` (toolchain components), `needed`/`found`/`visible` (device) or `signal`. Codes:
`bad-request`, `wrong-device`, `wrong-host`, `toolchain-drift`, `graph-drift`, `layout-drift`,
`layout-topology-mismatch`, `layout-below-sm-floor`, `layout-toolchain-unsupported` (the rule's
floor, this torch on this sm, or the kernel's probe on the device), `entry-error`,
`trace-failed`, `literal-hidden`, `dimension-mismatch`, `compile-failed`, `clamp-not-applied`,
`constant-table-mismatch`, `verify-mismatch`, `verify-failed`, `seal-failed`, adopt's refusal
codes from the serve stage (e.g. `weights-untied`, `literal-mismatch`), `mint-error`; retryable:
`oom`, `worker-killed`, `worker-signal`, `worker-crashed`, `timeout`. A failed mint leaves
its stage logs in `<out>/.mint-<key16>-<pid>/`.

The rooms: `worker` (the request, the sandbox lock, the phases, the seal: no torch), `stages`
(both sides of the conversation between the worker and its stage children), `compile` (the
compile stage), `package` (normalization), `check` (the check stage: verify, lane measurement,
the serve check; and the lane verdict the worker fits from it), `compare` (outputs against eager,
tolerances), `failure` (the typed failure every room raises).
"""

from cgbuild_rules.mint.compare import TOLERANCE, compare_outputs
from cgbuild_rules.mint.failure import MintFailure
from cgbuild_rules.mint.worker import DEFAULT_SANDBOX, mint

__all__ = ["DEFAULT_SANDBOX", "TOLERANCE", "MintFailure", "compare_outputs", "mint"]
