"""Workflows for the observability tests: a realistic mix of outcomes."""

from everystep import Terminal, current, parallel, step, workflow


@step
def reserve(order):
    return {"order": order, "reservation": f"r-{current().workflow_id}"}


@step
def charge(order, amount):
    if amount < 0:
        raise ValueError(f"cannot charge {amount}")
    return amount


@step
def notify(order, channel):
    return channel


@step
def check_stock(order):
    if order == "out-of-stock":
        raise Terminal("out of stock", {"order": order})
    return True


@step(unsafe_to_repeat=True)
def ship(order):
    return f"parcel-{order}"


@workflow
def place_order(order, amount):
    check_stock(order)
    reservation = reserve(order)
    try:
        charge(order, amount, everystep_id="charge")
    except ValueError:
        notify(order, "refund", everystep_id="refund")
        raise
    parallel(lambda: notify(order, "mail"), lambda: notify(order, "sms"), everystep_id="notify")
    ship(order)
    return reservation
