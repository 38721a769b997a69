#!/usr/bin/env python3
"""Writing events through the transactional outbox with psycopg 3: the
order's new status and its event commit together, or neither does.

What it shows, in a schema of its own that it drops at the end:

1. installing the outbox with `shardline outbox install`;
2. one transaction that updates an order's status and appends its event with
   `shardline_outbox_append`, which returns the event's seq;
3. one transaction that appends for several orders, in `order_id` order (so
   that two such transactions never wait for each other in a cycle);
4. a rolled-back transaction, which leaves no event and no gap;
5. seeding the counter of an order whose seqs 1 to 5 were published before
   the outbox, so that its next event gets 6.

It checks the seqs it got and exits non-zero when one is not what the outbox
promises (or anything fails).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \\
        SHARDLINE=target/debug/shardline python3 examples/outbox_append.py

Needs psycopg 3 (Debian: `apt-get install python3-psycopg`; else `pip install
psycopg[binary]`) and the `shardline` binary (`SHARDLINE`, else on PATH).
"""

import json
import os
import subprocess
import sys

import psycopg


def append(conn, order_id, event, data):
    """Appends `event` of `order_id` in the connection's transaction; its seq."""
    row = conn.execute(
        "SELECT shardline_outbox_append(%s, %s, %s::jsonb)",
        (order_id, event, json.dumps(data)),
    ).fetchone()
    return row[0]


def check(what, got, wanted):
    if got != wanted:
        raise SystemExit(f"outbox example: {what}: {got}, expected {wanted}")


def example(conn, url, schema):
    # 1. Once per database (or schema), by whoever migrates it.
    shardline = os.environ.get("SHARDLINE", "shardline")
    subprocess.run(
        [shardline, "outbox", "install", "--database-url", url, "--schema", schema],
        check=True,
    )
    # The application's own table; the outbox's functions are found by the
    # search path like any other.
    conn.execute(f"SET search_path TO {schema}")
    conn.execute("CREATE TABLE orders (order_id text PRIMARY KEY, status text NOT NULL)")
    conn.execute("INSERT INTO orders VALUES ('A-1001', 'NEW'), ('A-1002', 'NEW'), ('A-1003', 'NEW')")

    # 2. The status and the event in one transaction.
    with conn.transaction():
        conn.execute("UPDATE orders SET status = 'PAID' WHERE order_id = %s", ("A-1001",))
        seq = append(conn, "A-1001", "payment.captured", {"amount": 4200})
    print(f"A-1001 payment.captured: seq {seq}")
    check("A-1001's first event", seq, 1)

    # 3. Several orders in one transaction: in order_id order, always. Each
    # append locks its order's counter until the commit; two transactions
    # that took the same orders in different orders could each hold the lock
    # the other waits for, and PostgreSQL would abort one of them.
    shipped = sorted(["A-1003", "A-1001", "A-1002"])
    with conn.transaction():
        seqs = []
        for order_id in shipped:
            conn.execute("UPDATE orders SET status = 'SHIPPED' WHERE order_id = %s", (order_id,))
            seqs.append(append(conn, order_id, "order.shipped", {}))
    for order_id, seq in zip(shipped, seqs):
        print(f"{order_id} order.shipped: seq {seq}")
    check("seqs of A-1001, A-1002, A-1003", seqs, [2, 1, 1])

    # 4. A rollback takes its events with it, and gives their seqs back.
    class Rollback(Exception):
        pass

    try:
        with conn.transaction():
            append(conn, "A-1002", "order.cancelled", {})
            raise Rollback
    except Rollback:
        pass
    with conn.transaction():
        seq = append(conn, "A-1002", "order.delivered", {})
    print(f"A-1002 order.delivered: seq {seq} (the rolled-back event left no gap)")
    check("A-1002's event after a rollback", seq, 2)

    # 5. Seqs 1 to 5 of order L-7 went out before the outbox: its next is 6.
    next_seq = conn.execute("SELECT shardline_outbox_seed(%s, %s)", ("L-7", 6)).fetchone()[0]
    with conn.transaction():
        seq = append(conn, "L-7", "order.returned", {})
    print(f"L-7 seeded at {next_seq}; order.returned: seq {seq}")
    check("L-7's first event through the outbox", seq, 6)

    # What the relay will publish, in id order; event_id is the message id,
    # {order}:{event}:{seq} the dedup key.
    rows = conn.execute(
        "SELECT order_id, event, seq, event_id FROM shardline_outbox ORDER BY id"
    ).fetchall()
    for order_id, event, seq, event_id in rows:
        print(f"outbox: {order_id}:{event}:{seq} event_id={event_id}")
    check("rows in the outbox", len(rows), 6)
    print("outbox example: ok")


def main():
    url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
    schema = f"outbox_example_py_{os.getpid()}"
    with psycopg.connect(url, autocommit=True) as conn:
        try:
            example(conn, url, schema)
        finally:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


if __name__ == "__main__":
    try:
        main()
    except (psycopg.Error, subprocess.CalledProcessError, OSError) as e:
        sys.exit(f"outbox example: {e}")
