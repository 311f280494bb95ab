"""Demo workflows, run by the shipped everystep.yaml: an order goes through
stock, payment and invoicing in parallel, then shipping. Some orders fail on
purpose so every ending shows up in the log: most complete, a few are stopped
by a `Terminal` (an address nobody can ship to), a few fail (a card declined).

Randomness and the clock live inside steps, never in the workflow body: a
replay must make the same step calls in the same order."""

from __future__ import annotations

import logging
import random
import time

from everystep import Terminal, current, parallel, step, workflow

log = logging.getLogger("everystep.demo")


def _order_id() -> str:
    return str(current().workflow_id)[-6:]


@step
def take_order(customer: str) -> dict:
    order = {"id": _order_id(), "customer": customer, "items": random.randint(1, 5),
             "amount": round(random.uniform(5, 200), 2)}
    log.info("order %s: %d items for %s, %.2f EUR", order["id"], order["items"], customer, order["amount"])
    return order


@step
def reserve_stock(order: dict) -> str:
    time.sleep(random.uniform(0.05, 0.3))
    log.info("order %s: reserved %d items", order["id"], order["items"])
    return f"reservation-{order['id']}"


@step
def charge_card(order: dict) -> str:
    time.sleep(random.uniform(0.05, 0.3))
    if random.random() < 0.08:
        raise RuntimeError(f"card declined for order {order['id']}")
    log.info("order %s: charged %.2f EUR", order["id"], order["amount"])
    return f"payment-{order['id']}"


@step
def write_invoice(order: dict) -> str:
    time.sleep(random.uniform(0.05, 0.2))
    log.info("order %s: invoice written", order["id"])
    return f"invoice-{order['id']}"


@step
def release_stock(reservation: str) -> None:
    log.info("%s released", reservation)


@step
def ship(order: dict) -> str:
    time.sleep(random.uniform(0.1, 0.5))
    if random.random() < 0.05:
        raise Terminal("the address cannot be shipped to; a human takes over", {"order": order["id"]})
    log.info("order %s: shipped", order["id"])
    return f"parcel-{order['id']}"


@workflow
def process_order(customer: str) -> dict:
    order = take_order(customer)
    reservation, invoice = parallel(lambda: reserve_stock(order), lambda: write_invoice(order))
    try:
        payment = charge_card(order)
    except RuntimeError:
        release_stock(reservation)  # durable cleanup: replays serve it from the record
        raise
    parcel = ship(order)
    return {"order": order["id"], "payment": payment, "invoice": invoice, "parcel": parcel}
