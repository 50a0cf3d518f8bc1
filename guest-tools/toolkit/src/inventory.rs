//! Stock and orders, in the shape of tau-bench's retail database: `products/<product_id>`
//! with `variants.<item_id>.{available, price, options}` plus a `stock` count of our own,
//! and `orders/<order_id>`.

use serde_json::{Value, json};

use crate::common::{
    Args, Context, Plugin, Store, StoreExt, ToolError, ToolSpec, compensator_schema, count_of, from_cents,
    nothing_to_undo, record_id, to_cents, undo_target, unknown_tool,
};

pub struct Inventory;

impl Plugin for Inventory {
    fn manifest() -> Vec<ToolSpec> {
        vec![
            ToolSpec::query(
                "check",
                "Stock and price of a product's variants.",
                json!({
                    "type": "object",
                    "properties": {
                        "product_id": { "type": "string" },
                        "item_id": { "type": "string" }
                    },
                    "required": ["product_id"]
                }),
            ),
            ToolSpec::action(
                "reserve",
                "Takes items out of stock for a new pending order; returns the order id.",
                json!({
                    "type": "object",
                    "properties": {
                        "user_id": { "type": "string" },
                        "items": {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "type": "object",
                                "properties": {
                                    "product_id": { "type": "string" },
                                    "item_id": { "type": "string" },
                                    "quantity": { "type": "integer", "minimum": 1 }
                                },
                                "required": ["product_id", "item_id"]
                            }
                        }
                    },
                    "required": ["items"]
                }),
                "release",
            ),
            ToolSpec::undo(
                "release",
                "Puts a pending order's items back in stock and removes the order.",
                compensator_schema("order_id"),
            ),
        ]
    }

    fn call(store: &mut dyn Store, tool: &str, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
        match tool {
            "check" => check(store, args),
            "reserve" => reserve(store, args, ctx),
            "release" => release(store, args),
            other => Err(unknown_tool(other)),
        }
    }
}

fn check(store: &mut dyn Store, args: &Value) -> Result<Value, ToolError> {
    let a = Args(args);
    let product_id = a.str("product_id")?;
    let product = store.existing("products", product_id, "product")?;
    let variants = match a.opt_str("item_id") {
        Some(item) => json!({ item: product["variants"].get(item).cloned().unwrap_or(Value::Null) }),
        None => product["variants"].clone(),
    };
    Ok(json!({ "product_id": product_id, "name": product["name"], "variants": variants }))
}

fn reserve(store: &mut dyn Store, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
    let a = Args(args);
    let id = record_id("#W", &ctx.idempotency_key);
    if let Some(existing) = store.doc("orders", &id)? {
        return Ok(confirmation(&existing));
    }
    let mut lines = Vec::new();
    let mut total = 0;
    for wanted in args["items"].as_array().into_iter().flatten() {
        let w = Args(wanted);
        let (product_id, item_id) = (w.str("product_id")?, w.str("item_id")?);
        let quantity = w.count("quantity", 1)?;
        let mut product = store.existing("products", product_id, "product")?;
        let name = product["name"].clone();
        let variant = product["variants"]
            .get_mut(item_id)
            .ok_or_else(|| ToolError::Rejected(format!("product {product_id} has no item {item_id}")))?;
        let stock = count_of(variant, "stock");
        if variant["available"] != true || stock < quantity {
            return Err(ToolError::Rejected(format!("item {item_id} is out of stock: {stock} left, {quantity} asked")));
        }
        variant["stock"] = json!(stock - quantity);
        variant["available"] = json!(stock > quantity);
        let price = to_cents(&variant["price"]).unwrap_or(0);
        total += price * quantity as i64;
        lines.push(json!({
            "product_id": product_id,
            "item_id": item_id,
            "name": name,
            "options": variant["options"],
            "price": from_cents(price),
            "quantity": quantity,
        }));
        store.put_doc("products", product_id, &product)?;
    }
    let order = json!({
        "order_id": id,
        "user_id": a.opt_str("user_id"),
        "items": lines,
        "total": from_cents(total),
        "status": "pending",
        "fulfillments": [],
        "payment_history": [],
    });
    store.put_doc("orders", &id, &order)?;
    Ok(confirmation(&order))
}

fn confirmation(order: &Value) -> Value {
    json!({
        "order_id": order["order_id"],
        "confirmationNumber": order["order_id"],
        "total": order["total"],
        "items": order["items"].as_array().map_or(0, Vec::len),
    })
}

fn release(store: &mut dyn Store, args: &Value) -> Result<Value, ToolError> {
    let id = undo_target(args, "order_id", "#W")?;
    let Some(order) = store.doc("orders", &id)? else {
        return Ok(nothing_to_undo(&id));
    };
    if order["status"] != "pending" {
        return Err(ToolError::Rejected(format!("order {id} is {}, too late to release", order["status"])));
    }
    for line in order["items"].as_array().into_iter().flatten() {
        let product_id = line["product_id"].as_str().unwrap_or_default();
        let item_id = line["item_id"].as_str().unwrap_or_default();
        let Some(mut product) = store.doc("products", product_id)? else { continue };
        if let Some(variant) = product["variants"].get_mut(item_id) {
            variant["stock"] = json!(count_of(variant, "stock") + count_of(line, "quantity"));
            variant["available"] = json!(true);
            store.put_doc("products", product_id, &product)?;
        }
    }
    store.delete("orders", &id)?;
    Ok(json!({ "undone": true, "id": id }))
}
