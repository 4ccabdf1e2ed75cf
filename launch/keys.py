"""`odmoe-keys`: a cluster's key material in one command (the layout is odmoe/transport/security.py's).

    odmoe-keys init DIR --workers 4 --host 192.168.1.10   # node keys, TLS certificate, client token
    odmoe-keys add DIR worker4                             # one more node's keypair
    odmoe-keys revoke DIR worker2                          # take worker2's key off the allow-list
    odmoe-keys show DIR                                    # what is there and which box needs what
    odmoe-keys rotate-join DIR                             # a new join-link secret (old links refused)

A key's name is its role: `main` (every main, standbys included), `shadow`, `worker<i>`. Each node
socket admits only the roles that talk to it (a worker's ROUTER: main; the shadow's control socket:
main; the shadow's predictions: main and the workers), so a worker's key cannot act as main or as
the shadow, nor the shadow's as a worker.

`revoke` moves public/NODE.key to revoked/ (kept: `show` lists it, and the key stays refused even if
a copy comes back into public/) and deletes private/NODE.key_secret; `add DIR NODE` afterwards makes
a NEW keypair for the name. Running nodes re-read public/ and revoked/ at their next CURVE handshake,
so no restart is needed: move public/NODE.key into revoked/ on every other box too, and that key is
refused from then on, and main drops a worker holding it within a second (a subscription it
already holds to the shadow's predictions stays until it drops). docs/failures-and-security.md has
the steps.

`--host` names every address clients reach main by (repeat it; the HTTPS API checks it, gRPC
clients check the certificate's own name instead). Secrets are written 0600 under a 0700 folder.
Exit codes: 0 done, 2 a bad argument or key directory (the message says which file and why).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from odmoe.transport.security import (
    KeyDir,
    SecurityError,
    add_node_key,
    init_key_dir,
    load_keypair,
    read_token,
    revoke_node_key,
    revoked_nodes,
)

BAD_INPUT = 2


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="odmoe-keys", description="Make an odmoe cluster's keys.")
    sub = p.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="create a cluster's keys in DIR")
    init.add_argument("dir", type=Path)
    init.add_argument("--workers", type=int, required=True, help="how many worker keys (worker0..N-1)")
    init.add_argument("--host", action="append", default=[], help="an address of main (repeatable)")
    add = sub.add_parser("add", help="add one node's new keypair (e.g. worker4) to DIR")
    add.add_argument("dir", type=Path)
    add.add_argument("name", help="main, shadow or worker<i>: the key's role")
    revoke = sub.add_parser(
        "revoke",
        help="take NODE's key off the allow-list (moved to DIR/revoked/; running nodes refuse it "
        "from their next handshake once public/NODE.key is moved there on their box too)",
    )
    revoke.add_argument("dir", type=Path)
    revoke.add_argument("name", metavar="NODE")
    show = sub.add_parser("show", help="list DIR's keys and check their permissions")
    show.add_argument("dir", type=Path)
    rotate = sub.add_parser(
        "rotate-join",
        help="a new secret for the join link (main's next admission checks it: links with the old one "
        "are refused); DIR/join-link is rewritten with it",
    )
    rotate.add_argument("dir", type=Path)
    return p.parse_args(argv)


def rotate_join(keys: KeyDir) -> str:
    """A new join secret in DIR/join_secret (0600) and DIR/join-link rewritten; returns the new line."""
    import secrets as random

    secret_file = keys.root / "join_secret"
    if not keys.token.exists():
        raise SecurityError(f"{keys.root} holds no cluster keys (odmoe-keys init, or main's first start)")
    fresh = random.token_urlsafe(24)
    tmp = secret_file.with_name(".join_secret.tmp")
    tmp.touch(mode=0o600)
    tmp.chmod(0o600)
    tmp.write_text(fresh + "\n")
    tmp.replace(secret_file)
    link_file = keys.root / "join-link"
    if not link_file.is_file():
        return f"new join secret in {secret_file}; main prints its link at its next start"
    old = link_file.read_text().strip()
    prefix, _, rest = old.partition("odmoe://")
    line = f"{prefix}odmoe://{fresh}@{rest.partition('@')[2]}"
    link_file.write_text(line + "\n")
    return f"the join link is now (also in {link_file}):\n    {line}"


def show(keys: KeyDir) -> str:
    nodes = sorted(p.name.removesuffix(".key_secret") for p in keys.private.glob("*.key_secret"))
    for name in nodes:
        load_keypair(keys.secret_key(name))  # raises on a bad mode or format
    read_token(keys.token)
    revoked = revoked_nodes(keys)
    return "\n".join(
        [
            f"{keys.root}: nodes {', '.join(nodes)}",
            *(
                [f"  revoked:         {', '.join(revoked)}   (revoked/: refused by every node)"]
                if revoked
                else []
            ),
            "  every box:       public/  tls/cert.pem  token",
            "  node box only:   private/<that node>.key_secret   (main: private/main.key_secret)",
            "  main boxes only: tls/key.pem",
            "  clients:         tls/cert.pem  token",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        if args.command == "init":
            if args.workers < 1:
                raise SecurityError(f"--workers must be at least 1, got {args.workers}")
            keys = init_key_dir(args.dir, args.workers, tuple(args.host))
            print(show(keys))
        elif args.command == "add":
            add_node_key(KeyDir(args.dir), args.name)
            print(f"added {args.name}: copy {KeyDir(args.dir).public_key(args.name)} to every box")
        elif args.command == "revoke":
            keys = KeyDir(args.dir)
            kept = revoke_node_key(keys, args.name)
            print(
                f"revoked {args.name}: its public key is now {kept}. On every other box move "
                f"public/{args.name}.key into revoked/ too: running nodes refuse the key from their "
                f"next handshake. `odmoe-keys add {args.dir} {args.name}` makes a new keypair."
            )
        elif args.command == "rotate-join":
            print(rotate_join(KeyDir(args.dir)))
        else:
            print(show(KeyDir(args.dir)))
    except (SecurityError, OSError) as exc:
        print(f"odmoe-keys: {exc}", file=sys.stderr)
        return BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
