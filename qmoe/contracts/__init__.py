"""The contract every layer of qmoe shares: errors, element formats, enums, carriers, validators.

It imports nothing of qmoe outside itself, so kernels and their pure-torch reference twins
check and describe their arguments with the same code: a wrong checker or constant cannot
pass a kernel-vs-reference test by being wrong on both sides.

    errors      UnsupportedError, refuse_compile
    formats     ElementFormat (E4M3, E5M2, E2M1), block sizes, scale helpers
    enums       Scaling, ScoreFunction, Activation, GroupedPath, GemmRoute and their parsers
    carriers    RowIdMap, ActivatedRows, RowsWithAmax, AmaxSlot, activation constants, row/group helpers
    validate    one validator per concept (split sizes, routing, aux losses, permute, activation)
"""
