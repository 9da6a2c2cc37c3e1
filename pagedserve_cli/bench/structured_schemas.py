"""Twenty JSON schemas with a prompt each (nested objects, arrays, enums, required and optional properties, bounded
numbers, patterned strings): structured output's tests and bench/structured.py ask the default model for them."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
TEXT = {"type": "string", "maxLength": 60}


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


SCHEMAS: list[tuple[str, str, dict]] = [
    ("person", "Describe a person as JSON with a name and an age.",
     obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("city", "Give a city, its country and its population as JSON.",
     obj({"city": NAME, "country": NAME, "population": {"type": "integer", "minimum": 0, "maximum": 40_000_000}})),
    ("color", "Pick a primary color and say how much you like it from 1 to 10, as JSON.",
     obj({"color": {"enum": ["red", "green", "blue"]}, "liking": {"type": "integer", "minimum": 1, "maximum": 10}})),
    ("todo", "Write a short to-do list as JSON.",
     obj({"title": NAME, "items": {"type": "array", "items": TEXT, "minItems": 1, "maxItems": 4}})),
    ("address", "Write a postal address as JSON.",
     obj({"street": TEXT, "city": NAME, "zip": {"type": "string", "pattern": r"^[0-9]{5}$"}})),
    ("order", "Write a shop order as JSON: a customer and the items bought.",
     obj({"customer": obj({"name": NAME, "email": {"type": "string", "pattern": r"^[a-z]{1,10}@[a-z]{1,10}\.com$"}}),
          "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": obj({
              "sku": {"type": "string", "pattern": r"^[A-Z]{2}-[0-9]{3}$"},
              "qty": {"type": "integer", "minimum": 1, "maximum": 9}})}})),
    ("weather", "Report today's weather as JSON.",
     obj({"temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
          "sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}, "wind_kmh": {"type": "integer", "minimum": 0,
                                                                              "maximum": 200}},
         ["temperature_c", "sky"])),
    ("book", "Describe a book as JSON.",
     obj({"title": TEXT, "author": NAME, "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
          "genres": {"type": "array", "items": {"enum": ["fiction", "history", "science", "poetry"]},
                     "maxItems": 3}}, ["title", "author"])),
    ("date", "Give a date as JSON.",
     obj({"date": {"type": "string", "pattern": r"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"},
          "weekday": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]}})),
    ("flags", "Describe a user's settings as JSON with true/false values.",
     obj({"dark_mode": {"type": "boolean"}, "notifications": {"type": "boolean"},
          "language": {"enum": ["en", "fr", "de"]}})),
    ("point", "Give a point on a map as JSON.",
     obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
          "lon": {"type": "number", "minimum": -180, "maximum": 180}, "label": NAME}, ["lat", "lon"])),
    ("team", "Describe a small team as JSON: its name and its members with their roles.",
     obj({"team": NAME, "members": {"type": "array", "minItems": 1, "maxItems": 3, "items": obj({
         "name": NAME, "role": {"enum": ["lead", "dev", "qa"]}})}})),
    ("rating", "Rate a movie as JSON.",
     obj({"movie": TEXT, "stars": {"type": "integer", "minimum": 1, "maximum": 5}, "review": TEXT},
         ["movie", "stars"])),
    ("inventory", "List the stock of a small shop as JSON.",
     obj({"products": {"type": "array", "minItems": 1, "maxItems": 3, "items": obj({
         "name": NAME, "price": {"type": "number", "minimum": 0, "maximum": 1000},
         "in_stock": {"type": "boolean"}})}})),
    ("nested", "Describe a company as JSON with its headquarters and its CEO.",
     obj({"company": NAME, "hq": obj({"city": NAME, "country": NAME}),
          "ceo": obj({"name": NAME, "since": {"type": "integer", "minimum": 1900, "maximum": 2030}})})),
    ("phone", "Give a contact as JSON with a phone number.",
     obj({"name": NAME, "phone": {"type": "string", "pattern": r"^\+[0-9]{2} [0-9]{3} [0-9]{4}$"}})),
    ("status", "Report the status of a server as JSON.",
     obj({"host": {"type": "string", "pattern": r"^[a-z]{2,8}[0-9]{1,2}$"},
          "state": {"enum": ["up", "down", "degraded"]}, "load": {"type": "number", "minimum": 0, "maximum": 1},
          "uptime_days": {"type": "integer", "minimum": 0, "maximum": 9999}}, ["host", "state"])),
    ("recipe", "Write a recipe as JSON: its name, its ingredients and how many minutes it takes.",
     obj({"name": NAME, "ingredients": {"type": "array", "minItems": 1, "maxItems": 4, "items": obj({
         "item": NAME, "grams": {"type": "integer", "minimum": 1, "maximum": 2000}})},
         "minutes": {"type": "integer", "minimum": 1, "maximum": 600}})),
    ("event", "Describe a meeting as JSON.",
     obj({"topic": TEXT, "time": {"type": "string", "pattern": r"^([01][0-9]|2[0-3]):[0-5][0-9]$"},
          "attendees": {"type": "integer", "minimum": 1, "maximum": 50},
          "online": {"type": "boolean"}}, ["topic", "time"])),
    ("choice", "Answer as JSON: is water wet, and how sure are you?",
     obj({"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
]
