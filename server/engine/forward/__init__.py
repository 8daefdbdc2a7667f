"""How the target computes a pass: a plan decided once at load, and the Forward built from it
(forward.choose.build_forward; the module docs of plan, passes, lean and head say more)."""
