"""Twenty JSON schemas of the shapes clients send (flat, nested, enums, arrays, unions, refs)."""

STR = {"type": "string", "maxLength": 12}

SCHEMAS = [
    {"type": "object", "properties": {"name": STR}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}}, "required": ["ok", "score"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": STR, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"}, "name": STR},
                                               "required": ["id", "name"]}}, "required": ["user"]},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}}},
     "required": ["points"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer"}},
     "required": ["status", "count"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}, "required": ["value"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"enum": [1, 2, 3]}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"level": {"enum": ["low", "mid", "high"]},
                                      "notes": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 4}},
     "required": ["level", "notes"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}}, "required": ["id"]},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 8},
                                      "name": STR}, "required": ["kind", "legs", "name"], "additionalProperties": False},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
     "required": ["start", "end"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer"}}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["ratio"]},
    {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"circle": {"type": "integer"}}, "required": ["circle"]},
        {"type": "object", "properties": {"square": {"type": "integer"}}, "required": ["square"]}]}},
     "required": ["shape"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"enum": ["A1", "B2"]}, "qty": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 5}},
        "required": ["sku", "qty"]}}, "paid": {"type": "boolean"}}, "required": ["items", "paid"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer",
                                                                                          "minimum": 1, "maximum": 5},
                                      "reason": STR, "meta": {"type": "object", "properties": {
                                          "lang": {"enum": ["en", "fr"]}}, "required": ["lang"]}},
     "required": ["answer", "confidence", "reason", "meta"]},
]
