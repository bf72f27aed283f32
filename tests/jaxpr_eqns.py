"""The equations of a traced program, sub-jaxprs included (jit and loop bodies), Pallas kernels'
bodies left out: what the tests that check which products and kernels a program holds share."""


def equations(jaxpr):
    """Every equation of `jaxpr` (a Jaxpr) and of the jaxprs in its equations' parameters, in order;
    a pallas_call is yielded, its kernel body is not walked."""
    for e in jaxpr.eqns:
        yield e
        if e.primitive.name == "pallas_call":
            continue
        for v in e.params.values():
            if hasattr(v, "jaxpr") and hasattr(v, "consts"):
                yield from equations(v.jaxpr)
            elif hasattr(v, "eqns"):
                yield from equations(v)


def kernel_name(eqn) -> str:
    """A pallas_call equation's kernel name (with its source location where jax records one)."""
    return str(eqn.params.get("name_and_src_info", eqn.params.get("name", "")))
