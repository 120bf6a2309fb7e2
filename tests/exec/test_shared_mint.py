"""Mints that publish into the shared store, and what other machines do with what was published:
a clean clone plans it fresh without tracing, `fetch` pulls it with its signature, `inspect`
shows every card's evidence, adopt serves it or refuses an untrusted copy, a mint that lost the
publish race is told which artifact stands. Against each S3 server of the `s3` fixture (moto,
SeaweedFS) on loopback.

One real toy artifact (one CPU compile of the MLP) is minted through the CLI and published once
for the module (`published`), so every test here that needs a real one shares it.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.cli import cli, last_json
from support.publishers import trusted
from support.s3 import BUCKET, S3, Proxy, child_env
from support.shared import artifact, forge, shared_at
from support.toy import toy_with_remote

from cgbuild.config import cgfile
from cgbuild.protocol.mint import MintFailed
from cgbuild.store.local import Store
from cgbuild.store.s3 import Remote
from cgbuild.store.shared import SEEN_TTL_S, SharedStore, seen_path
from cgbuild.store.trust import SIGNING_KEY_ENV, load_signer

MLP8 = "//toy/mlp/8x64-b1@fp32:cpu"


@pytest.fixture(scope="module")
def published(
    s3: S3, keys: dict[str, tuple[Path, str]], toy_reference: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str, str]:
    """(publisher workspace, remote URL, key): the toy's MLP8 minted once and published."""
    url = f"s3://{BUCKET}/toy-{secrets.token_hex(3)}"
    ws = toy_with_remote(tmp_path_factory.mktemp("publisher") / "toy", toy_reference, url, [keys["ci"][1]])
    proc = cli(ws, "mint", MLP8, "--json", env=child_env(s3, **{SIGNING_KEY_ENV: str(keys["ci"][0])}))
    summary = last_json(proc)
    assert proc.returncode == 0, summary
    (minted,) = summary["minted"]
    assert minted["admission"] == "admitted"
    return ws, url, minted["key"]


@pytest.fixture
def clone_on(keys: dict[str, tuple[Path, str]], toy_reference: Path, tmp_path: Path) -> Callable[[str], Path]:
    """A clean clone of the toy workspace (`tmp_path/clone`) on the store at a URL, trusting `ci`."""
    return lambda url: toy_with_remote(tmp_path / "clone", toy_reference, url, [keys["ci"][1]])


@pytest.mark.slow
def test_mint_publishes_and_a_clean_clone_plans_fresh_without_tracing(
    published: tuple[Path, str, str], s3: S3, clone_on: Callable[[str], Path]
) -> None:
    _, url, key = published
    remote = Remote(url)
    ref = remote.get_json(remote.ref_name(key))
    assert ref is not None and ref.doc["signature"]["key_id"] and ref.doc["metadata"]["labels"] == [MLP8]
    assert remote.has_object(ref.doc["object"], ref.doc["size"])
    assert list(remote.list_names(f"evidence/{key}")) and list(remote.list_names("facts"))
    clone = clone_on(url)
    with Proxy(s3) as proxy:
        env = child_env(s3, AWS_ENDPOINT_URL=proxy.url, **{SIGNING_KEY_ENV: None})
        plan = cli(clone, "plan", MLP8, "--json", env=env)
        (target,) = last_json(plan)["targets"]
        assert target["status"] == "fresh" and target["key"] == key
        assert "tracing [" not in plan.stderr  # the facts came from the remote: no trace ran
        lists = proxy.requests("GET", "list-type=2")
        assert len([p for p in lists if "refs%2F" in p]) == 1 and not proxy.requests("GET", "/refs/")
        proxy.log.clear()
        fetched = last_json(cli(clone, "fetch", MLP8, "--json", env=env))
        assert [(p["key"], p["signer"]) for p in fetched["pulled"]] == [(key, "ci")]
        assert not fetched["refused"]
        cache = Store(clone / ".cgbuild" / "store")
        assert cache.read_ref(key).metadata["signature"] == ref.doc["signature"]  # type: ignore[union-attr]
        assert last_json(cli(clone, "fetch", MLP8, "--json", env=env))["local"] == 1
        again = last_json(cli(clone, "mint", MLP8, "--json", env=env))
        assert again["fresh"] == 1 and again["minted"] == []
        # a publishing mint without a signing key is refused before anything compiles
        other = "//toy/mlp/16x64-b1@fp32:cpu"
        proc = cli(clone, "mint", other, "--json", env=env)
        (failed,) = last_json(proc)["failed"]
        assert proc.returncode == 1 and failed["code"] == "no-signing-key" and failed["phase"] == "publish"
        assert not (clone / ".cgbuild" / "mint" / f"{failed['key']}.log").exists()


def _copy(source: Remote, prefix: str, subs: tuple[str, ...]) -> Remote:
    """A store under `prefix` holding what `source` holds under `subs`, copied by the server."""
    remote = Remote(f"s3://{BUCKET}/{prefix}")
    for sub in subs:
        for n in source.list_names(sub):
            copied = {"Bucket": BUCKET, "Key": source.name(sub, n)}
            remote.client.copy_object(Bucket=BUCKET, CopySource=copied, Key=remote.name(sub, n))
    return remote


def _listed(proxy: Proxy) -> list[str]:
    """What each listing the proxy forwarded listed: `refs`, `quarantine`, `facts`."""
    return [p.split("prefix=", 1)[1].split("%2F")[1] for _, p in proxy.log if "list-type=2" in p]


@pytest.mark.slow
def test_a_no_op_plan_the_remembered_listing_vouches_for_is_served_from_the_memo(
    published: tuple[Path, str, str],
    s3: S3,
    keys: dict[str, tuple[Path, str]],
    clone_on: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    """With a shared store, a key fresh only by the remote is served from the memo at the cost of
    one listing of `quarantine/` (never of `refs/`), and stops being served the moment the key is
    quarantined or the remembered listing it rests on is older than its TTL."""
    _, published_url, key = published
    prefix = f"memo-{secrets.token_hex(3)}"
    remote = _copy(Remote(published_url), prefix, ("refs", "objects", "facts"))  # this test quarantines
    clone = clone_on(remote.url)
    with Proxy(s3) as proxy:
        env = child_env(s3, AWS_ENDPOINT_URL=proxy.url, **{SIGNING_KEY_ENV: None})

        def plan() -> tuple[str, list[str]]:
            proxy.log.clear()
            proc = cli(clone, "plan", MLP8, "--json", env=env)
            assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
            return proc.stdout, _listed(proxy)

        first, listed = plan()  # lists refs/ and remembers it: the listing moved, so no memo yet
        assert json.loads(first)["targets"][0]["status"] == "fresh" and "refs" in listed
        second, listed = plan()  # from the remembered listing, in full: now memoised
        assert listed == ["quarantine"] and json.loads(second)["targets"][0]["status"] == "fresh"
        memos = clone / ".cgbuild" / "cache" / "plans"
        (index,) = memos.glob("*.json")
        doc = json.loads(index.read_text())
        assert [row[:2] for row in doc["store"]] == [[key, "listed"]] and doc["listed_at"]
        stamp = index.stat().st_mtime_ns, index.stat().st_ino
        third, listed = plan()
        assert third == second and listed == ["quarantine"]
        assert (index.stat().st_mtime_ns, index.stat().st_ino) == stamp, "the no-op plan was not a memo hit"

        # the remembered listing is past its TTL (its file unchanged): the memo does not serve it
        index.write_text(json.dumps({**doc, "listed_at": time.time() - SEEN_TTL_S - 1}))
        aged = index.stat().st_mtime_ns, index.stat().st_ino
        assert plan()[0] == second and (index.stat().st_mtime_ns, index.stat().st_ino) != aged

        # another machine quarantines the key: the memo stops vouching for it at once
        other = shared_at(tmp_path / "other", prefix, keys, host="host-b")
        seen = other.remote.get_json(other.remote.ref_name(key))
        assert seen is not None
        other.quarantine_remote(key, seen, "bad bytes")
        after, listed = plan()
        assert json.loads(after)["targets"][0]["status"] == "mint" and "refs" in listed


@pytest.mark.slow
def test_mint_publishes_what_only_this_cache_holds(
    published: tuple[Path, str, str], s3: S3, keys: dict[str, tuple[Path, str]], tmp_path: Path
) -> None:
    """A key admitted here but not in the remote (its publish failed after the local admission, or
    it was minted before the remote was declared) reads fresh in plan: mint publishes it from the
    cache, signed as admitted, instead of leaving it on this machine for good. A store answering
    503 SlowDown past botocore's retries makes the mint one line, `remote-unavailable` (exit 2, no
    traceback), that changes nothing here and remembers no listing; the next mint publishes."""
    ws, _, key = published
    moved = shutil.copytree(ws, tmp_path / "toy")
    url = f"s3://{BUCKET}/republish-{secrets.token_hex(3)}"
    cg = moved / "Cgfile"
    declared = f"remote = {json.dumps(url)}"
    cg.write_text(re.sub(r"^remote = .*$", declared, cg.read_text(), count=1, flags=re.M))
    remote = Remote(url)
    assert key not in remote.list_keys()
    env = child_env(s3, **{SIGNING_KEY_ENV: str(keys["ci"][0])})
    cache = Store(moved / ".cgbuild" / "store")
    with Proxy(s3, slow_down=10**6) as shedding:
        down = cli(moved, "mint", MLP8, "--json", env={**env, "AWS_ENDPOINT_URL": shedding.url})
    assert down.returncode == 2 and "Traceback" not in down.stderr and not down.stdout, down.stderr
    error = down.stderr.strip().splitlines()[-1]
    where = f"{moved / 'Cgfile'}:3: field 'workspace.remote'"  # the line that declares the store
    assert error.startswith(f"cgbuild: error: {where}: remote-unavailable: "), error
    assert "SlowDown" in error and "reached max retries" in error
    assert cache.ref_state(key) == "fresh" and not seen_path(cache.root, url).exists()
    proc = cli(moved, "mint", MLP8, "--json", env=env)
    summary = last_json(proc)
    assert proc.returncode == 0, summary
    assert summary["minted"] == [] and summary["published"] == [{"key": key, "publish": "admitted"}]
    ref = remote.get_json(remote.ref_name(key))
    local = cache.read_ref(key)
    assert ref is not None and local is not None
    assert (ref.doc["object"], ref.doc["signature"]) == (local.object, local.metadata["signature"])
    assert remote.has_object(local.object, local.size)
    with Proxy(s3) as proxy:  # what this cache published it remembers: no listing of refs
        again = cli(moved, "mint", MLP8, "--json", env={**env, "AWS_ENDPOINT_URL": proxy.url})
        assert last_json(again)["published"] == []
        assert not [p for p in proxy.requests("GET", "list-type=2") if "refs" in p]


@pytest.mark.slow
def test_a_key_published_elsewhere_after_the_listing_was_remembered_is_found_not_minted(
    published: tuple[Path, str, str],
    s3: S3,
    keys: dict[str, tuple[Path, str]],
    clone_on: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The remembered listing vouches only for the keys it names (docs/store.md): a key it does not
    name is looked for in `refs/` again, within its TTL as past it. So a key another machine
    published after this machine's listing was taken plans `fresh`, and a mint of it finds the ref
    and compiles nothing (fetch or adopt pulls it, verified)."""
    ws, published_url, key = published
    remote = _copy(Remote(published_url), f"later-{secrets.token_hex(3)}", ("facts",))  # no tracing
    named = "0" * 64  # a key the remembered listing names, so that it is no empty listing
    assert remote.create(remote.ref_name(named), b"{}")
    clone = clone_on(remote.url)
    with Proxy(s3) as proxy:
        env = child_env(s3, AWS_ENDPOINT_URL=proxy.url, **{SIGNING_KEY_ENV: None})

        def run(*args: str) -> tuple[dict[str, Any], list[str]]:
            proxy.log.clear()
            return last_json(cli(clone, *args, MLP8, "--json", env=env)), _listed(proxy)

        assert run("plan")[0]["targets"][0]["status"] == "mint"
        remembered = seen_path(clone / ".cgbuild" / "store", remote.url)
        taken = json.loads(remembered.read_text())
        assert taken["keys"] == [named]
        monkeypatch.setenv(SIGNING_KEY_ENV, str(keys["ci"][0]))  # the publisher, from its own cache
        elsewhere = SharedStore(Store(ws / ".cgbuild" / "store"), remote, trusted(keys["ci"][1]), "ci")
        assert elsewhere.republish(key)[0] == "admitted"

        plan, listed = run("plan")  # within the TTL: the listing does not name the key
        assert plan["targets"][0]["status"] == "fresh" and listed == ["quarantine", "refs"]
        remembered.write_text(json.dumps(taken))  # the listing as it was taken, still young
        minted, listed = run("mint")
        assert minted["fresh"] == 1 and minted["minted"] == [] and minted["failed"] == []
        assert "refs" in listed and not (clone / ".cgbuild" / "mint" / f"{key}.log").exists()
        remembered.write_text(json.dumps({**taken, "listed_at": taken["listed_at"] - SEEN_TTL_S - 1}))
        plan, listed = run("plan")  # past the TTL: listed again, the quarantine list not needed
        assert plan["targets"][0]["status"] == "fresh" and listed == ["refs"]
        fetched, _ = run("fetch")
        assert [(p["key"], p["signer"]) for p in fetched["pulled"]] == [(key, "ci")]


@pytest.mark.slow
def test_inspect_shows_every_cards_evidence_from_the_shared_store(
    published: tuple[Path, str, str], s3: S3, keys: dict[str, tuple[Path, str]], tmp_path: Path
) -> None:
    ws, url, key = published
    card_b = SharedStore(Store(tmp_path / "b"), Remote(url), trusted(keys["ci"][1]), "card-b")
    assert card_b.add_evidence(key, {"how": "mint", "measured": {}}) is None
    proc = cli(ws, "inspect", key, "--json", env=child_env(s3))
    assert proc.returncode == 0, proc.stderr
    evidence = json.loads(proc.stdout)["lane_evidence"]
    assert evidence["card-b"]["runs"] == [{"how": "mint", "measured": {}}]
    assert len(evidence) == 2  # the publisher's own mint run, from the remote, and card-b's


@pytest.mark.slow
def test_fetch_reports_a_key_the_store_refuses_and_goes_on(
    published: tuple[Path, str, str], s3: S3, clone_on: Callable[[str], Path]
) -> None:
    _, url, key = published
    clone = clone_on(url)
    with Proxy(s3, deny="/objects/") as proxy:  # refs readable, objects forbidden
        proc = cli(clone, "fetch", MLP8, "--json", env=child_env(s3, AWS_ENDPOINT_URL=proxy.url))
    summary = last_json(proc)
    assert proc.returncode == 1 and summary["pulled"] == []
    (refused,) = summary["refused"]
    assert refused["key"] == key and refused["code"] == "remote-error" and "AccessDenied" in refused["detail"]
    assert Store(clone / ".cgbuild" / "store").read_ref(key) is None


def _toy_module(ws_path: Path) -> Any:
    from cgbuild.config.targets import expand
    from cgbuild.plan.planner import Workspace
    from cgbuild.protocol.trace import job_for

    ws = Workspace(cgfile.load(ws_path / "Cgfile"))
    job = job_for(ws.cg, next(t for t in expand(ws.cg) if t.label == MLP8)).to_json()
    sys.path.insert(0, str(ws_path))
    try:
        import toy_models
    finally:
        sys.path.remove(str(ws_path))
    return toy_models.build({**job["spec"], "config": job["config"]})[0].eval()


@pytest.mark.slow
def test_adopt_pulls_verified_artifacts_and_refuses_untrusted_ones(
    published: tuple[Path, str, str], s3: S3, keys: dict[str, tuple[Path, str]], tmp_path: Path
) -> None:
    import torch
    from cgbuild_rules.adopt import AdoptRefused, adopt

    from cgbuild.store import trust

    ws_path, url, key = published
    module = _toy_module(ws_path)
    x = torch.randn(1, 8, 64)
    shared = SharedStore(Store(tmp_path / "cache"), Remote(url), trusted(keys["ci"][1]), "server")
    served = adopt(key, module, store=shared)
    assert served.refusals == {} and served.armed
    with torch.no_grad():
        torch.testing.assert_close(served(x), module(x), rtol=1e-5, atol=1e-6)
    good = shared.local.resolve(key).path
    stranger_only = SharedStore(Store(tmp_path / "s"), Remote(url), trusted(keys["stranger"][1]), "server")
    assert next(iter(adopt(key, module, store=stranger_only).refusals.values())).code == "unknown-signer"

    flipped = bytearray(good.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    swapped = tmp_path / "swapped.bin"
    swapped.write_bytes(bytes(flipped))
    ci = load_signer({SIGNING_KEY_ENV: str(keys["ci"][0])})
    assert ci is not None
    from cgbuild.core.canon import sha256_file

    signed_good = ci.sign(trust.artifact_statement(key, sha256_file(str(good)), good.stat().st_size))
    for name, source, signature, code in (
        ("unsigned", good, None, "unsigned"),
        ("swapped", swapped, signed_good, "bad-signature"),
    ):
        forged = SharedStore(
            Store(tmp_path / name), Remote(f"{url}-{name}"), trusted(keys["ci"][1]), "server"
        )
        forge(forged, key, source, signature)
        served = adopt(key, module, store=forged)
        (refusal,) = served.refusals.values()
        assert refusal.code == code, refusal
        assert forged.local.read_ref(key) is None
        with torch.no_grad():
            torch.testing.assert_close(served(x), module(x))
        assert served.counters == {f"eager:{code}": 1}
        with pytest.raises(AdoptRefused, match=code):
            adopt(key, module, store=forged, strict=True)


@pytest.mark.slow
def test_adopt_serves_eager_when_the_remote_is_unreachable(
    published: tuple[Path, str, str], keys: dict[str, tuple[Path, str]], tmp_path: Path
) -> None:
    from cgbuild_rules.adopt import adopt

    ws_path, url, key = published
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        mp.setenv("AWS_MAX_ATTEMPTS", "1")
        shared = SharedStore(Store(tmp_path / "cache"), Remote(url), trusted(keys["ci"][1]), "server")
        (refusal,) = adopt(key, _toy_module(ws_path), store=shared).refusals.values()
    assert refusal.code == "remote-unavailable"


@pytest.mark.slow
def test_a_mint_that_loses_the_race_is_told_which_artifact_stands(
    published: tuple[Path, str, str],
    keys: dict[str, tuple[Path, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another machine published first, between this machine's plan and its publish."""
    from cgbuild.config.labels import parse_selector
    from cgbuild.core.canon import sha256_file
    from cgbuild.exec import mint
    from cgbuild.plan.planner import Workspace, make_plan
    from cgbuild.store import trust

    monkeypatch.setenv(SIGNING_KEY_ENV, str(keys["ci"][0]))
    ws_path, url, _ = published
    ws = Workspace(cgfile.load(ws_path / "Cgfile"))
    ws.cg.remote, ws.cg.store_dir = f"{url}-race", tmp_path / "store"
    (mk,) = mint.approved(make_plan(ws, parse_selector(MLP8)), ws)
    first = artifact(tmp_path)
    ci = load_signer()
    assert ci is not None and ws.remote is not None
    sha, size = sha256_file(str(first)), first.stat().st_size
    rival = SharedStore(Store(tmp_path / "rival"), ws.remote, ws.cg.trusted, "rival")
    assert (
        rival.publish(mk.key, first, sha, size, ci.sign(trust.artifact_statement(mk.key, sha, size)), {})[0]
        == "admitted"
    )
    store = Store(ws.cg.store_dir)
    result = mint.mint_one(ws, mk, store).result
    assert isinstance(result, MintFailed), result
    assert result.code == "conflict" and result.phase == "admit" and result.facts["standing"] == sha
    assert store.ref_state(mk.key) == "quarantined"  # this machine's copy does not linger
    assert SharedStore(Store(tmp_path / "c"), ws.remote, ws.cg.trusted, "c").resolve(mk.key).ref.object == sha
