"""`cgbuild trust keygen PATH`: make a publisher key pair for a shared store.

The private key goes to PATH (PEM, mode 0600, never overwritten) and is used by pointing
CGBUILD_SIGNING_KEY at it; the public half goes to PATH.pub and is printed as the entry to add to
the Cgfile's `[workspace] trusted` list. The private key never belongs in the Cgfile.
"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

from cgbuild.cli.render import print_json
from cgbuild.core.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    gen = sub.add_parser("keygen", help="write an ed25519 key pair and print its trusted entry")
    gen.add_argument("path", type=Path, help="where the private key goes (PATH.pub gets the public line)")
    gen.add_argument("--name", help="the publisher's name in `trusted` (default: this host's name)")
    gen.add_argument("--json", action="store_true", help="print {path, public, trusted} as JSON")


def run(args: argparse.Namespace) -> int:
    from cgbuild.config.reader import NAME
    from cgbuild.store.trust import SIGNING_KEY_ENV, keygen

    name = args.name or socket.gethostname().split(".")[0].lower()
    if not NAME.fullmatch(name):
        raise UserError(f"bad publisher name '{name}': names use [a-z0-9._-]", field="--name")
    try:
        line = keygen(args.path, name)
    except FileExistsError:
        raise UserError("exists; a key is never overwritten", file=str(args.path)) from None
    except OSError as e:
        raise UserError(f"cannot write the key: {e.strerror}", file=str(args.path)) from None
    if args.json:
        print_json({"path": str(args.path), "public": f"{args.path}.pub", "trusted": line})
        return 0
    print(f"wrote {args.path} (private, 0600) and {args.path}.pub")
    print(f"publish with:  export {SIGNING_KEY_ENV}={args.path}")
    print("trust it in the Cgfile's [workspace]:")
    print(f'trusted = ["{line}"]')
    return 0
